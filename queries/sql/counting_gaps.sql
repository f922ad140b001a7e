-- counting-bottleneck's gaps per regime, from the hidden-number probe's per-board N_H (tokens a per-token
-- probe labels black; probe_predictions.prediction per test board): Vision Gap =
-- mean |N_H - N_G| (what the encoder holds vs the truth), Language Gap = mean |N_H - N_P| (what
-- the encoder holds vs what the model says), with N_G the true count and N_P the parsed answer of
-- the same run. The Language Gap is over the answers that are numbers (answer_kind 'digits'): an
-- unparsed, empty or word answer, and a runaway one (no EOS within the cap: its digits were cut,
-- not answered), is left out; number_answers says how many boards it rests on. Means over probe seeds.
-- param: run  a run id, or '%' for every run (default '%')
-- The generic form of this comparison, for any probe and grouping: queries/gap.py (python -m queries gap).
WITH nh AS (
    SELECT p.run, p.tap, p.layer, p.site, p.seed, pp.array_row, pp.prediction AS n_h
    FROM probes p
    JOIN probe_predictions pp USING (key)
    WHERE p.kind = 'hidden_number' AND p.run LIKE $run AND pp.prediction IS NOT NULL
)
SELECT nh.run, nh.tap, nh.layer, nh.site, s.truth->>'regime' AS regime, count(*) AS boards,
       round(avg(abs(nh.n_h - (s.truth->>'count')::DOUBLE)), 3) AS vision_gap,
       round(avg(abs(nh.n_h - s.prediction::DOUBLE)) FILTER (WHERE s.answer_kind = 'digits'), 3) AS language_gap,
       count(*) FILTER (WHERE s.answer_kind = 'digits') AS number_answers,
       round(avg((nh.n_h = (s.truth->>'count')::DOUBLE)::INTEGER), 4) AS probe_exact,
       round(avg(s.correct::INTEGER), 4) AS model_accuracy
FROM nh
JOIN v_samples s ON s.run = nh.run AND s.array_row = nh.array_row
GROUP BY ALL
ORDER BY nh.run, nh.tap, nh.layer, regime;
