-- Counting lab (Go boards): accuracy and mean absolute error per regime
-- (ID 0-49 seen in vision training, VE 50-99 text-only, FE 100-120 never seen), how often the
-- answer held no number at all, and the mean number of digits answered (format collapse shows
-- as one digit where two or three are due).
-- param: run   a run id, or '%' for every run (default '%')
SELECT g.run, st.truth->>'regime' AS regime, count(*) AS n,
       round(avg(g.correct::INTEGER), 4) AS accuracy,
       round(avg(abs(g.prediction::INTEGER - (st.truth->>'count')::INTEGER)), 2) AS mean_abs_error,
       round(avg((NOT g.parse_ok)::INTEGER), 4) AS empty_rate,
       round(avg(length(regexp_replace(g.text, '[^0-9]', '', 'g'))), 2) AS mean_digits
FROM generations g
JOIN stimuli st USING (stimulus)
WHERE st.family = 'go' AND g.run LIKE $run
GROUP BY 1, 2
ORDER BY 1, CASE regime WHEN 'ID' THEN 0 WHEN 'VE' THEN 1 ELSE 2 END;
