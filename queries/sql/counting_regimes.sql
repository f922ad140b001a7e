-- Counting lab (Go boards): accuracy per regime (ID 0-49 seen in vision training, VE 50-99 text-only,
-- FE 100-120 never seen) and what the answers are (generations.answer_kind): a number, runaway (no
-- EOS within the run's cap max_new_tokens: cut, not ended), a word without a digit (e.g. False), or
-- empty. Runs of the contrastive true/false task (task *_tf) are left out: their answers are no counts.
-- The mean absolute error and the mean digits are over the number answers only (NULL when
-- there are none): the digits of a cut answer measure the cap, not the model. runaway_rate is 0 for
-- rows recorded before stop reasons were kept (stop_reason NULL: stop_unknown counts them).
-- param: run   a run id, or '%' for every run (default '%')
SELECT g.run, st.truth->>'regime' AS regime, count(*) AS n,
       any_value(r.config->'generation'->>'max_new_tokens') AS max_new_tokens,
       round(avg(g.correct::INTEGER), 4) AS accuracy,
       round(avg(abs(TRY_CAST(g.prediction AS DOUBLE) - (st.truth->>'count')::DOUBLE))
             FILTER (WHERE g.answer_kind = 'digits'), 2) AS mean_abs_error,
       round(avg((g.answer_kind = 'digits')::INTEGER), 4) AS number_rate,
       round(avg((g.answer_kind = 'runaway')::INTEGER), 4) AS runaway_rate,
       round(avg((g.answer_kind = 'word')::INTEGER), 4) AS word_rate,
       round(avg((g.answer_kind = 'empty')::INTEGER), 4) AS empty_rate,
       round(avg(length(regexp_replace(g.text, '[^0-9]', '', 'g'))) FILTER (WHERE g.answer_kind = 'digits'), 2)
           AS mean_digits,
       count(*) FILTER (WHERE g.stop_reason IS NULL) AS stop_unknown
FROM generations g
JOIN stimuli st USING (stimulus)
LEFT JOIN runs r USING (run)
WHERE st.family = 'go' AND g.run LIKE $run
      AND NOT ends_with(coalesce(r.config->'stimuli'->0->>'task', ''), '_tf')   -- counts, not the true/false task
GROUP BY 1, 2
ORDER BY 1, CASE regime WHEN 'ID' THEN 0 WHEN 'VE' THEN 1 ELSE 2 END;
