"""One settings object from the configuration to the record: ``calibrate`` takes a ``CalibrationSettings``, the
record stores it as ``record.settings`` (schema 5), and records and shards written with flat settings (schema 4 and
older) still load, migrated, under the hash they were written with."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from setgrpo_verl.core import calibrate, CalibrationRecord, CalibrationSettings, SCHEMA_VERSION, VARIANTS
from setgrpo_verl.core.record import content_sha256, pilot_start
from setgrpo_verl.core.shards import CalibrationShard, load_shards, read_shard, shard_identity, write_shard

from .synthetic import make_groups

#: A fixed-sequence record written by the schema-4 code (flat settings fields; package versions left empty).
SCHEMA_4 = Path(__file__).parent / "data" / "record_schema4.json"
#: The settings that record was calibrated with (seed 11 groups below, split_seed 3).
SCHEMA_4_SETTINGS = CalibrationSettings(alpha=0.2, beta=0.3, delta=0.1, tau_grid=(0.0, 0.2, 0.4, 0.6),
                                        srgo_procedure="fixed_sequence", tau_start=0.6, on_infeasible="reject_all",
                                        coverage_groups=100)

#: What the keyword-argument ``calibrate`` of schema 4 returned for these groups and settings (computed with it
#: before the settings object replaced the keyword arguments): (settings, split_seed, results).
BEFORE = {
    "bonferroni": (
        CalibrationSettings(alpha=0.2, beta=0.3, delta=0.1, tau_grid=(0.0, 0.2, 0.4, 0.6),
                            on_infeasible="reject_all"), 3,
        {"q_alpha": 0.8097610036727804, "n_cov": 300, "n_risk": 300, "n_accepted": (115, 93, 52, 15),
         "n_reversals": (1, 0, 0, 0),
         "ucb": (0.047496946884995214, 0.0388889985342758, 0.06848220870331956, 0.218019360910534),
         "utility": (0.33539791666666663, 0.239434375, 0.12063776041666666, 0.027759635416666668),
         "tau_sel": 0.0, "coverage_risk_set": 0.84, "test_order": (0, 1, 2, 3)}),
    "fixed_sequence": (
        SCHEMA_4_SETTINGS, 3,
        {"q_alpha": 0.7249472451599339, "n_cov": 100, "n_risk": 500, "n_accepted": (239, 179, 121, 40),
         "n_reversals": (2, 1, 0, 0),
         "ucb": (0.022114798973280718, 0.02155562966627439, 0.018849708560057268, 0.055939123714076625),
         "utility": (0.40053296875, 0.2829678125, 0.1672721875, 0.045987187500000005),
         "tau_sel": 0.0, "coverage_risk_set": 0.772, "test_order": (3, 2, 1, 0)}),
    "fixed_threshold": (
        CalibrationSettings(alpha=0.2, beta=0.3, delta=0.1, tau_grid=(0.0, 0.4), ablation="fixed_threshold",
                            fixed_tau=0.2, rho=0.05, grid_size=20, norm_by_std=False), 0,
        {"q_alpha": 0.5158024269975424, "n_cov": 300, "n_risk": 300, "n_accepted": (112, 55, 11),
         "n_reversals": (1, 1, 0),
         "ucb": (0.04582983448645993, 0.09152410534414362, 0.26596587672246025),
         "utility": (0.3015791015625, 0.13667805989583334, 0.025242513020833333),
         "tau_sel": 0.2, "coverage_risk_set": 0.85, "test_order": (0, 1, 2)}),
}


@pytest.fixture(scope="module")
def groups():
    return make_groups(600, k=5, dim=3, noise=0.15, seed=11)


@pytest.mark.parametrize("case", sorted(BEFORE))
def test_calibrate_with_settings_gives_the_results_of_the_keyword_form(groups, case):
    settings, split_seed, want = BEFORE[case]
    rec = calibrate(*groups, settings, split_seed=split_seed)
    assert rec.settings == settings and rec.schema_version == SCHEMA_VERSION == 6
    got = {name: getattr(rec, name) for name in want}
    floats = ("q_alpha", "ucb", "utility", "coverage_risk_set")
    assert {k: v for k, v in got.items() if k not in floats} == {k: v for k, v in want.items() if k not in floats}
    for name in floats:
        assert np.allclose(got[name], want[name], rtol=1e-12, atol=0), name


def test_calibrate_refuses_anything_but_a_settings_object(groups):
    with pytest.raises(TypeError, match=r"settings must be a CalibrationSettings, got dict: build one"):
        calibrate(*groups, {"alpha": 0.2})


@pytest.mark.parametrize("settings", [
    CalibrationSettings(),
    SCHEMA_4_SETTINGS,
    CalibrationSettings(alpha=0.1, tau_grid=[0.0, 0.5], ablation="fixed_threshold", fixed_tau=0.25, grid_size=7,
                        risk_fraction=0.3, coverage_groups=None, norm_by_std=False, rho=0.0, eps=0.0),
])
def test_settings_round_trip_through_a_json_dict(settings):
    data = settings.to_dict()
    assert data["variant"] == "paper" and isinstance(data["tau_grid"], list)
    assert CalibrationSettings.from_dict(json.loads(json.dumps(data))) == settings


def test_settings_from_an_older_dict_and_refusals():
    old = CalibrationSettings(alpha=0.2).to_dict()
    del old["variant"]  # written before variants existed
    assert CalibrationSettings.from_dict(old) == CalibrationSettings(alpha=0.2) and VARIANTS == ("paper",)
    with pytest.raises(ValueError, match=r"variant='other': choose one of \('paper',\)"):
        CalibrationSettings(variant="other")
    with pytest.raises(ValueError, match=r"unknown keys \['alhpa'\]; the fields are \['alpha', 'beta'"):
        CalibrationSettings.from_dict({"alhpa": 0.2})
    with pytest.raises(ValueError, match="calibration settings are a JSON object, got list"):
        CalibrationSettings.from_dict([0.2])


def test_a_schema_4_record_loads_migrated_to_the_settings_it_was_calibrated_with(groups, tmp_path):
    stored = json.loads(SCHEMA_4.read_text())
    assert stored["schema_version"] == 4 and stored["alpha"] == 0.2 and "settings" not in stored
    old = CalibrationRecord.from_json(SCHEMA_4)
    assert old.settings == SCHEMA_4_SETTINGS and old.schema_version == 6
    want = BEFORE["fixed_sequence"][2]
    assert (old.n_cov, old.n_risk, old.n_accepted, old.n_reversals, old.tau_sel) == (
        want["n_cov"], want["n_risk"], want["n_accepted"], want["n_reversals"], want["tau_sel"])
    assert old.tau_start_source == {"kind": "user"} and old.created_at == "2026-01-01T00:00:00+00:00"
    # the same record as calibrating anew today, up to the provenance fields
    fresh = calibrate(*groups, SCHEMA_4_SETTINGS, split_seed=3, created_at=old.created_at)
    # the stored file was calibrated on another CPU: its floats (Q_alpha) may differ from today's in the last bits
    assert old.q_alpha == pytest.approx(fresh.q_alpha, rel=1e-12, abs=0)
    assert old == dataclasses.replace(fresh, package_versions={}, q_alpha=old.q_alpha)
    # it answers to the hash its file stores (resume state and pilot sources name it so) ...
    assert content_sha256(old) == stored["content_sha256"]
    # ... and lists no calibration prompts, so it can be no pilot: its start would have to be given as the user's
    with pytest.raises(ValueError, match=rf"lists no calibration prompts.*tau_start={old.tau_sel} without a pilot"):
        pilot_start(old, old.settings.tau_grid)
    # ... while written again it is a schema-6 file with its own hash, which reads back equal
    old.to_json(tmp_path / "record.json")
    again = json.loads((tmp_path / "record.json").read_text())
    assert again["schema_version"] == 6 and again["settings"] == SCHEMA_4_SETTINGS.to_dict()
    assert again["content_sha256"] != stored["content_sha256"] and "alpha" not in again
    assert CalibrationRecord.from_json(tmp_path / "record.json") == old
    # an edited old file is still refused
    edited = {**stored, "beta": 0.5}
    with pytest.raises(ValueError, match="content hash does not match"):
        CalibrationRecord.from_dict(edited)


def _as_schema_4(record: CalibrationRecord) -> dict:
    """``record`` as the schema-4 code wrote it: flat settings fields, no split shares, fixed_tau or variant."""
    data = record.to_dict()
    data.pop("content_sha256")
    settings = data.pop("settings")
    data.update({k: settings[k] for k in ("alpha", "beta", "delta", "rho", "tau_grid", "norm_by_std", "eps",
                                          "grid_size", "ablation", "on_infeasible", "srgo_procedure", "tau_start")},
                schema_version=4)
    data["content_sha256"] = hashlib.sha256(json.dumps(data, sort_keys=True, ensure_ascii=True).encode()).hexdigest()
    return data


@pytest.mark.parametrize("case", sorted(BEFORE))
def test_a_migrated_record_infers_what_the_flat_fields_left_out(groups, case):
    settings, split_seed, _ = BEFORE[case]
    rec = calibrate(*groups, settings, split_seed=split_seed)
    old = _as_schema_4(rec)
    back = CalibrationRecord.from_dict(old)
    # the split shares are the defaults where they give the record's counts (the 300/300 cases), else the cap is
    # the record's n_cov (100 of 600); fixed_tau is the fixed_threshold ablation's tau_sel
    assert back.settings == settings and back == rec
    assert content_sha256(back) == old["content_sha256"] != content_sha256(rec)


def test_a_shard_written_before_variants_reads_as_the_paper_variant(tmp_path):
    settings = CalibrationSettings(alpha=0.2, beta=0.4, delta=0.2, tau_grid=(0.0, 0.3))
    identity = shard_identity(k=4, settings=settings, split_seed=0, run={"grader": {"name": "judge"}},
                              prompts=[], batch_size=2)
    old_identity = {**identity, "settings": {k: v for k, v in identity["settings"].items() if k != "variant"}}
    point, reference, gram = (x.numpy() for x in make_groups(2, 4, seed=1))
    shard = CalibrationShard(index=0, prompts=(), point=point, reference=reference, gram=gram, truth=None,
                             prompt_index=np.arange(2), identity=old_identity)
    path = write_shard(tmp_path, shard)
    assert read_shard(path).identity == identity
    shards, _ = load_shards(tmp_path, identity)  # checked against this version's identity of the same settings
    assert list(shards) == [0]
