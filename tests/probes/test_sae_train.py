"""SAE training as a farm job (probes/sae/): on a workspace with planted sparse features the SAE
recovers their directions, its metrics are stored per SAE, its weights are in SAELens's layout
(and SAELens opens them and reconstructs the same), a stopped run resumes to the same weights,
and a plan that does not fit the worker limit is refused before training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from probetest_lib import python
from saetest_lib import D, build_planted, directions

from probes.errors import PlanError, ProbeError
from probes.sae import ActivationSource
from probes.sae.farm import check_memory, run_sae_plan
from probes.sae.model import SparseAutoencoder, load, save
from probes.sae.plan import expand_sae_plan, parse_sae_plan
from probes.sae.train import TrainSettings, train
from store import Workspace

RECOVER = {"architecture": "standard", "d_sae": 16, "l1": 0.1, "lr": 3e-3, "epochs": 25, "batch_size": 128,
           "buffer_rows": 2048}


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    return build_planted(tmp_path_factory.mktemp("sae") / "ws", n=240, sites=("resid_post", "resid_mid"))


def _plan(**entry: Any) -> Any:
    return parse_sae_plan({"name": "t", "saes": [{"taps": ["vision"], "layers": [1], **entry}]})


def test_planted_features_recovered_and_metrics_stored(ws: Workspace) -> None:
    rep = run_sae_plan(_plan(**RECOVER), ws.path, scheduler="inline", log=lambda _: None)
    assert (rep.trained, rep.failed) == (1, 0), rep.errors
    (row,) = ws.query("SELECT * FROM sae_models").to_pylist()
    assert row["architecture"] == "standard" and row["d_in"] == D and row["d_sae"] == 16
    assert row["n_train"] + row["n_test"] == 240 * 16 and row["n_test"] > 0
    assert row["explained_variance"] > 0.95 and 1.0 < row["l0"] < 6.0 and row["dead_share"] <= 0.25
    assert row["mse"] > 0 and row["rows_per_s"] > 0
    sae = load(ws.path / row["path"])
    w = sae.W_dec.detach().numpy()
    cos = directions() @ (w / np.linalg.norm(w, axis=1, keepdims=True)).T
    assert (cos.max(1) >= 0.9).all(), cos.max(1)
    # the same plan again: already recorded, nothing retrained
    again = run_sae_plan(_plan(**RECOVER), ws.path, in_process=True, log=lambda _: None)
    assert (again.trained, again.skipped) == (0, 1)


@pytest.mark.parametrize("arch", ["topk", "standard", "transcoder"])
def test_saelens_opens_the_files_and_reconstructs_identically(arch: str, tmp_path: Path) -> None:
    sae_lens = pytest.importorskip("sae_lens")
    ours = SparseAutoencoder(arch, D, 24, k=5 if arch == "topk" else None, d_out=D + 4 if arch == "transcoder" else None,
                             seed=3, metadata={"hook_name": "agnosia:test"})
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.1 * torch.randn_like(p))
    save(ours, tmp_path / arch)
    theirs = sae_lens.SAE.load_from_disk(tmp_path / arch)
    assert type(theirs).__name__ == {"topk": "TopKSAE", "standard": "StandardSAE", "transcoder": "Transcoder"}[arch]
    x = torch.randn(64, D)
    with torch.no_grad():
        assert torch.allclose(theirs.encode(x), ours.encode(x), atol=1e-5)
        assert torch.allclose(theirs.decode(theirs.encode(x)), ours(x), atol=1e-5)
    back = load(tmp_path / arch)
    assert all(torch.equal(a, b) for a, b in zip(back.parameters(), ours.parameters(), strict=True))


def test_a_stopped_run_resumes_to_the_same_weights(ws: Workspace, tmp_path: Path) -> None:
    def src() -> ActivationSource:
        return ActivationSource(ws, "planted", ["vision:1"], batch_size=256, buffer_rows=1024, seed=1)

    settings = TrainSettings(architecture="topk", d_sae=16, k=3, lr=3e-3, epochs=2, batch_size=256, buffer_rows=1024,
                             checkpoint_every=5)
    whole, _ = train(src(), settings, tmp_path / "whole")
    _, part = train(src(), settings, tmp_path / "split", stop_after=7)     # mid-epoch (15 batches an epoch)
    assert part.steps == 7 and not (tmp_path / "split" / "sae_weights.safetensors").exists()
    resumed, rest = train(src(), settings, tmp_path / "split")
    assert rest.resumed_at == 7 and rest.steps == 30
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_transcoder_between_two_sites(ws: Workspace) -> None:
    plan = _plan(architecture="transcoder", site="resid_mid", out_site="resid_post", d_sae=16, l1=0.05, lr=3e-3,
                 epochs=10, batch_size=128, buffer_rows=2048)
    rep = run_sae_plan(plan, ws.path, in_process=True, log=lambda _: None)
    assert rep.trained == 1, rep.errors
    row = ws.query("SELECT * FROM sae_models WHERE architecture = 'transcoder'").to_pylist()[0]
    assert row["site"] == "resid_mid" and row["out_site"] == "resid_post" and row["explained_variance"] > 0.9


def test_plans_are_checked_before_training(ws: Workspace) -> None:
    with pytest.raises(PlanError, match="out_site"):
        _plan(architecture="transcoder")
    with pytest.raises(PlanError, match="nope"):
        _plan(targets=["nope.target"])
    with pytest.raises(PlanError, match="not stored"):
        expand_sae_plan(_plan(layers=[5]), ws)
    (task,) = expand_sae_plan(_plan(expansion=2, buffer_rows=1 << 20), ws)
    assert task.d_sae == 2 * D
    with pytest.raises(ProbeError, match="buffer_rows"):
        check_memory([task], 384 << 20)
    check_memory([task], 2 << 30)


def test_the_sae_modules_import_neither_transformers_nor_sae_lens() -> None:
    got = python("-c", "import sys\nimport probes.sae.farm, probes.sae.cli, probes.sae.score, probes.sae.train\n"
                 "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'sae_lens', 'extract', 'queries'))\n"
                 "assert not bad, bad\nprint('ok')")
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr


def test_the_shipped_sae_plan_is_valid() -> None:
    from probes.sae.plan import load_sae_plan

    plan = load_sae_plan(Path(__file__).resolve().parents[2] / "manifests" / "sae-demo.yaml")
    assert plan.saes and plan.saes[0].targets
