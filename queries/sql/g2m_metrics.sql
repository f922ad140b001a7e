-- G2M end-to-end metrics per (run, N, C): Exact Match = exact grids / samples;
-- Cell Accuracy = correct cells / all ground-truth cells (a failed parse adds 0 correct and N*N
-- cells to the denominator), as Grid2Matrix reports them.
-- param: run   a run id, or '%' for every run (default '%')
SELECT g.run,
       (st.params->>'grid_size')::INTEGER AS grid_size,
       (st.params->>'num_colors')::INTEGER AS num_colors,
       count(*) AS n,
       round(avg(g.correct::INTEGER), 4) AS exact_match,
       round(sum((g.metrics->>'cells_correct')::BIGINT) / sum((g.metrics->>'cells_total')::BIGINT), 4) AS cell_accuracy,
       sum((NOT g.parse_ok)::INTEGER) AS parse_failures
FROM generations g
JOIN stimuli st USING (stimulus)
WHERE st.family = 'g2m' AND g.run LIKE $run
GROUP BY ALL
ORDER BY g.run, grid_size, num_colors;
