-- SAE features that track each truth variable, per depth: for every SAE (run, tap, layer, site) and
-- truth variable (target and class, metric: auroc, spearman or iou), the best feature with its score,
-- the shuffled-truth control, the bootstrap interval over test samples, n, the q-value
-- (Benjamini-Hochberg over the SAE's tests) and how many features pass q < 0.05 above their control;
-- beside it the best probe of the same target at the same array (v_probe_layers), where one was trained.
-- param: run     a run id, or '%' for every run (default '%')
-- param: target  a target name, or a LIKE pattern (default '%')
WITH best AS (
    SELECT sae, target, class, metric,
           arg_max(feature, score) AS feature, max(score) AS score,
           arg_max(control_score, score) AS control, arg_max(ci_low, score) AS ci_low,
           arg_max(ci_high, score) AS ci_high, arg_max(q_value, score) AS q_value, arg_max(n, score) AS n,
           count(*) FILTER (WHERE q_value < 0.05 AND score > control_score) AS n_tracking
    FROM sae_feature_scores
    WHERE score IS NOT NULL AND NOT isnan(score)
    GROUP BY sae, target, class, metric
), probe AS (
    SELECT run, tap, layer, site, tokens, split_part(target, '#', 1) AS target,
           arg_max(kind, score) AS probe_kind, arg_max(metric, score) AS probe_metric,
           max(score) AS probe_score, arg_max(control_score, score) AS probe_control
    FROM v_probe_layers
    GROUP BY ALL
)
SELECT m.run, m.tap, m.layer, a.depth, a.stage, m.site, m.tokens, m.architecture, m.d_sae,
       b.target, b.class, b.metric, b.feature,
       round(b.score, 4) AS score, round(b.control, 4) AS control,
       round(b.ci_low, 4) AS ci_low, round(b.ci_high, 4) AS ci_high, b.n, b.q_value, b.n_tracking,
       round(m.explained_variance, 4) AS explained_variance, round(m.l0, 2) AS l0,
       p.probe_kind, p.probe_metric, round(p.probe_score, 4) AS probe_score, round(p.probe_control, 4) AS probe_control,
       m.key AS sae
FROM best b
JOIN sae_models m ON m.key = b.sae
LEFT JOIN activations a ON a.run = m.run AND a.tap = m.tap AND a.layer = m.layer AND a.site = m.site
                       AND a.tokens = m.tokens
LEFT JOIN probe p ON p.run = m.run AND p.tap = m.tap AND p.layer = m.layer AND p.site = m.site
                 AND p.tokens = m.tokens AND p.target = b.target
WHERE m.run LIKE $run AND b.target LIKE $target
ORDER BY m.run, b.target, b.class, b.metric, m.architecture, a.depth, m.tap, m.layer;
