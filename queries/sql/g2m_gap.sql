-- G2M's gap curve (study g2m): per grid size N, the cell accuracy of a spatial probe on a tap's
-- image tokens (per test grid: probe_predictions.score of the conv_spatial probe) beside the
-- model's own end-to-end cell accuracy on the same grids; gap = probe - model. A large gap at large
-- N means the encoder still holds the grid the model fails to write out. Means over probe seeds.
-- param: run  a run id, or '%' for every run (default '%')
-- The generic form of this comparison, for any probe and grouping: queries/gap.py (python -m queries gap).
WITH per_grid AS (
    SELECT p.run, p.tap, p.layer, p.site, p.seed, pp.array_row, pp.score AS probe_ca
    FROM probes p
    JOIN probe_predictions pp USING (key)
    WHERE p.kind = 'conv_spatial' AND p.run LIKE $run AND pp.score IS NOT NULL
)
SELECT g.run, g.tap, g.layer, g.site, (s.params->>'grid_size')::INTEGER AS grid_size, count(*) AS grids,
       round(avg(g.probe_ca), 4) AS probe_cell_accuracy,
       round(avg((gen.metrics->>'cells_correct')::DOUBLE / (gen.metrics->>'cells_total')::DOUBLE), 4)
           AS model_cell_accuracy,
       round(avg(g.probe_ca) - avg((gen.metrics->>'cells_correct')::DOUBLE / (gen.metrics->>'cells_total')::DOUBLE), 4)
           AS gap
FROM per_grid g
JOIN v_samples s ON s.run = g.run AND s.array_row = g.array_row
LEFT JOIN generations gen ON gen.run = g.run AND gen.stimulus = s.stimulus
GROUP BY ALL
ORDER BY g.run, g.tap, g.layer, grid_size;
