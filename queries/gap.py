"""Where along the model is the information lost? The gap primitive.

:func:`gap` takes any probes (a run, a target, a kind: usually one probe series trained at every
tap and layer) and any grouping of the stimuli (an SQL expression over ``v_samples``: the regime,
the grid size N, the case, a count bin, any ``truth`` field) and returns, per probe position along
the model's data path (``activations.depth``) and per group, what the probe decodes on that group's
test samples beside what the model itself answers on the same samples, and their difference:

* ``probe_accuracy``: the mean per-sample score (1/0 correct, token or cell accuracy, AP@50);
  for a regression probe, the share of samples whose rounded prediction equals the truth.
* ``probe_mae``, ``probe_r2``, ``mean_prediction``: where the probe predicts one number per
  sample (a count read-out, the hidden number N_H): mean absolute error, R^2 within the group,
  and the mean prediction (a read-out that saturates shows the same value whatever the truth).
* ``model_accuracy`` (the mean of ``model_score``: ``v_samples.correct`` unless told, e.g. ``score``
  for G2M's cell accuracy) and ``model_mae`` (the model's number, ``answer``, vs the
  probe's truth, over number answers: a runaway answer, digits until the generation cap, is wrong
  but is no number, and would put 10^9 into a mean), then ``gap_accuracy = probe_accuracy - model_accuracy`` and
  ``gap_mae = model_mae - probe_mae``: positive when the layer holds more than the model says.
* ``probe_answer_mae``: mean |probe prediction - the model's number| (counting-bottleneck's Language
  Gap), over the ``n_answers`` samples whose answer is a number.
* ``selectivity``: the probe's test score minus its shuffled-label control in the probe's own
  metric (accuracy - accuracy, AP - AP), averaged over seeds. For R^2 the floor is the better of
  the control and 0 (predicting the mean): a shuffled ridge's R^2 can fall to -30 on held-out
  samples, which would make any probe look selective.

Where a target is lost is not read off this table: one read-out's largest step cannot tell a loss
from a re-encoding, nor either from noise. ``python -m queries lost`` (queries/verdicts.py) decides
that from two probe series and their controls with bootstrap intervals (docs/verdicts.md).
A selection with no per-sample predictions to compute from is an error that says why
(:func:`explain_empty`), never an empty table that reads as an answer.

Two named queries are instances of ``gap`` (:data:`INSTANCES`: fixed parameters, then a ``SELECT``
over its rows that names the columns as the study does): ``counting_gaps`` (counting-bottleneck's
Vision Gap = ``probe_mae`` and Language Gap = ``probe_answer_mae`` of the ``hidden_number`` probe per
regime) and ``g2m_gap`` (G2M's curve: the ``conv_spatial`` probe's cell accuracy beside the model's,
``generations.score``, per grid size N).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from store import StoreError, Workspace

#: Parameters of ``python -m queries gap`` / ``lost`` (name -> (default, help)).
PARAMS: dict[str, tuple[str | None, str]] = {
    "run": ("%", "run id, or a LIKE pattern"),
    "target": ("%", "probe target, or a LIKE pattern (e.g. truth:count)"),
    "kind": ("%", "probe kind, or a LIKE pattern"),
    "tokens": ("%", "token kind of the probed arrays (image, last, ...)"),
    "group_by": ("'all'", "SQL over v_samples naming each sample's group, e.g. truth->>'regime'"),
    "where": ("true", "SQL over v_samples: which samples count"),
    "model_score": ("correct::INTEGER", "SQL over v_samples: the model's score per sample, 0..1 (e.g. score)"),
    "answer": ("CASE WHEN answer_kind = 'runaway' THEN NULL"  # a capped digit string is no number the model meant
               " ELSE try_cast(trim(CAST(prediction AS VARCHAR), '\"') AS DOUBLE) END",
               "SQL over v_samples: the model's answer as a number (NULL: none)"),
}
#: The parameters bound as DuckDB parameters; the others are SQL text formatted into the query.
_BOUND = ("run", "target", "kind", "tokens")

_SQL = """
WITH p AS (
    SELECT p.key, p.run, p.tap, p.layer, p.site, p.tokens, p.target, p.kind, p.metric,
           coalesce(p.series, p.target || '/' || p.kind) AS series, a.depth, a.stage
    FROM probes p
    LEFT JOIN activations a ON a.run = p.run AND a.tap = p.tap AND a.layer = p.layer AND a.site = p.site
                           AND a.tokens = p.tokens
    WHERE p.run LIKE $run AND p.target LIKE $target AND p.kind LIKE $kind AND p.tokens LIKE $tokens
),
sel AS (
    SELECT p.series, p.run, p.tap, p.layer, p.site, p.tokens,
           avg(pr.score) - CASE WHEN any_value(pr.metric) = 'r2' THEN greatest(avg(pr.control_score), 0)
                                ELSE avg(pr.control_score) END AS selectivity,
           count(*) AS n_seeds
    FROM p JOIN probes pr USING (key)
    GROUP BY ALL
),
s AS (
    SELECT run, array_row, CAST(({group_by}) AS VARCHAR) AS grp, ({model_score})::DOUBLE AS model_score,
           ({answer})::DOUBLE AS answer
    FROM v_samples
    WHERE run LIKE $run AND ({where})
),
j AS (
    SELECT p.*, pp.array_row, pp.prediction, pp.truth, pp.score AS sample_score, s.grp, s.model_score, s.answer
    FROM p
    JOIN probe_predictions pp USING (key)
    JOIN s ON s.run = p.run AND s.array_row = pp.array_row
),
g AS (
    SELECT run, target, kind, metric, series, depth, stage, tap, layer, site, tokens, grp AS "group",
           count(DISTINCT array_row) AS n,
           coalesce(avg(sample_score), avg((round(prediction) = truth)::INTEGER)) AS probe_accuracy,
           avg(abs(prediction - truth)) AS probe_mae,
           1 - avg((prediction - truth) ^ 2) / nullif(var_pop(truth), 0) AS probe_r2,
           avg(prediction) AS mean_prediction, stddev_pop(truth) AS truth_sd,
           avg(model_score) AS model_accuracy,
           avg(abs(answer - truth)) AS model_mae,
           avg(abs(prediction - answer)) AS probe_answer_mae,
           count(DISTINCT array_row) FILTER (WHERE answer IS NOT NULL) AS n_answers
    FROM j
    GROUP BY ALL
)
SELECT g.run, g.target, g.kind, g.metric, g.series, g.depth, g.stage, g.tap, g.layer, g.site, g.tokens, g."group",
       g.n, sel.n_seeds, round(g.probe_accuracy, 4) AS probe_accuracy, round(g.probe_mae, 3) AS probe_mae,
       round(g.probe_r2, 4) AS probe_r2, round(g.mean_prediction, 3) AS mean_prediction,
       round(g.truth_sd, 3) AS truth_sd,
       round(g.model_accuracy, 4) AS model_accuracy, round(g.model_mae, 3) AS model_mae,
       round(g.probe_accuracy - g.model_accuracy, 4) AS gap_accuracy,
       round(g.model_mae - g.probe_mae, 3) AS gap_mae,
       round(sel.selectivity, 4) AS selectivity,
       round(g.probe_answer_mae, 3) AS probe_answer_mae, g.n_answers
FROM g
JOIN sel USING (series, run, tap, layer, site, tokens)
ORDER BY g.run, g.target, g.kind, g.series, g."group", g.depth NULLS LAST, g.tap, g.layer
"""


class GapError(ValueError):
    """The gap's parameters are wrong; the message says which and the fix."""


def bind(params: dict[str, str] | None) -> dict[str, str]:
    params = dict(params or {})
    unknown = set(params) - set(PARAMS)
    if unknown:
        raise GapError(f"gap has no parameter {', '.join(sorted(unknown))}; its parameters: {', '.join(PARAMS)}")
    return {name: params.get(name) or default or "" for name, (default, _) in PARAMS.items()}


def gap_sql(p: dict[str, str], inline: tuple[str, ...] = ()) -> str:
    """The gap's SQL for bound parameters ``p``; the ``_BOUND`` ones named in ``inline`` become SQL
    string literals (a named instance fixes them), the rest stay ``$name`` parameters."""
    sql = _SQL.format(group_by=p["group_by"], where=p["where"], model_score=p["model_score"], answer=p["answer"])
    for name in inline:
        sql = sql.replace(f"${name}", "'" + p[name].replace("'", "''") + "'")
    return sql


def gap(ws: Workspace, params: dict[str, str] | None = None) -> pa.Table:
    """Probe decodability per depth and group beside the model's accuracy (module docstring)."""
    p = bind(params)
    bound = {k: p[k] for k in _BOUND}
    try:
        table = ws.query(gap_sql(p), bound)
    except StoreError as err:
        raise GapError(f"gap on {ws.path}: {err} (group_by and where are SQL over v_samples, as are model_score and"
                       " answer, e.g. group_by=\"truth->>'regime'\"; list its columns with python -m queries --schema)"
                       ) from err
    if not table.num_rows:
        explain_empty(ws, bound)   # an empty table would read as an answer: say why there is none
    return table


def explain_empty(ws: Workspace, bound: dict[str, str]) -> None:
    """No rows: say whether no probe matched, or matching probes stored no per-sample predictions."""
    probes = ws.rows("SELECT kind, count(*), count(pp.key) FROM probes p LEFT JOIN (SELECT DISTINCT key FROM"
                     " probe_predictions) pp USING (key) WHERE p.run LIKE $run AND p.target LIKE $target AND"
                     " p.kind LIKE $kind AND p.tokens LIKE $tokens GROUP BY kind ORDER BY kind", bound)
    if not probes:
        raise GapError(f"no probe in {ws.path} matches run={bound['run']} target={bound['target']} kind={bound['kind']}"
                       f" tokens={bound['tokens']}: train one first (python -m probes PLAN), or widen the parameters"
                       " (python -m queries probe_leaderboard lists what is stored)")
    bare = [f"{kind} ({n} probes)" for kind, n, with_rows in probes if with_rows == 0]
    if bare:
        raise GapError(f"the matching probes of kind {', '.join(bare)} stored no per-sample test predictions, so there"
                       " is nothing to compute a curve from: retrain them with this version (python -m probes PLAN"
                       " --force) or choose another kind")
    raise GapError("the matching probes' test samples fall outside where= or their arrays have no depth: widen where")


@dataclass(frozen=True)
class Instance:
    """A named query that is :func:`gap` with parameters fixed (all but ``run``) and a ``SELECT``
    over its rows (the CTE ``gap``) that keeps and names the columns its study reports."""

    name: str
    description: str
    fixed: dict[str, str]
    select: str

    def sql(self) -> str:
        inner = gap_sql(bind(self.fixed), inline=tuple(k for k in _BOUND if k != "run"))
        return f"WITH gap AS (\n{inner}\n)\n{self.select}"


INSTANCES = (
    Instance(
        "counting_gaps",
        "counting-bottleneck's gaps per regime, an instance of the gap primitive (queries/gap.py) on the"
        " hidden_number probe: Vision Gap = mean |N_H - N_G| (what the encoder holds vs the true count),"
        " Language Gap = mean |N_H - N_P| (vs the model's parsed answer, over the answers that are numbers:"
        " answer_kind 'digits'; a word, empty or runaway answer is left out, number_answers says how many"
        " boards it rests on). boards = test boards; means over probe seeds.",
        {"kind": "hidden_number", "group_by": "truth->>'regime'",
         "answer": "CASE WHEN answer_kind = 'digits' THEN try_cast(trim(CAST(prediction AS VARCHAR), '\"') AS DOUBLE) END"},
        "SELECT run, tap, layer, site, \"group\" AS regime, n AS boards, probe_mae AS vision_gap,\n"
        "       probe_answer_mae AS language_gap, n_answers AS number_answers, probe_accuracy AS probe_exact,\n"
        "       model_accuracy, depth, target\n"
        "FROM gap ORDER BY run, depth NULLS LAST, tap, layer, site, target, regime"),
    Instance(
        "g2m_gap",
        "G2M's gap curve, an instance of the gap primitive (queries/gap.py) on the conv_spatial probe: per"
        " grid size N, the probe's cell accuracy on a tap's image tokens beside the model's own cell accuracy"
        " (generations.score) on the same test grids; gap = probe - model. A large gap at large N means the"
        " encoder still holds the grid the model fails to write out. Means over probe seeds.",
        {"kind": "conv_spatial", "group_by": "params->>'grid_size'", "model_score": "score"},
        "SELECT run, tap, layer, site, CAST(\"group\" AS INTEGER) AS grid_size, n AS grids,\n"
        "       probe_accuracy AS probe_cell_accuracy, model_accuracy AS model_cell_accuracy, gap_accuracy AS gap,\n"
        "       depth, target\n"
        "FROM gap ORDER BY run, depth NULLS LAST, tap, layer, site, target, grid_size"),
)
