"""The architecture sweep (issue 30): its catalog, its generic small configs, its resumable runner and table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.sweep.catalog import SMALL_SIZES, hf_entries, shrink_config, timm_entries
from benchmarks.sweep.run import error_class, main


def test_shrink_config_sets_every_size_field_the_config_has() -> None:
    from benchmarks.common.torchvision_ops import declare_torchvision_ops

    declare_torchvision_ops()
    import transformers

    bert = shrink_config(transformers.BertConfig())
    assert (bert.hidden_size, bert.num_hidden_layers, bert.num_attention_heads, bert.intermediate_size) == \
        (32, 2, 2, 64)
    assert bert.num_labels == SMALL_SIZES["num_labels"] and bert.vocab_size == 30522  # vocabulary kept
    resnet = shrink_config(transformers.ResNetConfig())
    assert resnet.hidden_sizes == [16, 32, 64, 128] and list(resnet.depths) == [1, 1, 1, 1]


def test_catalog_has_every_auto_mapping_type_once_and_one_model_per_timm_family() -> None:
    import timm
    from timm.models import _registry
    from transformers.models.auto import modeling_auto as auto

    hf = hf_entries()
    mappings = ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
                "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    types = {t for m in mappings for t, cls in getattr(auto, m).items() if isinstance(cls, str)}
    assert sorted(e.name for e in hf) == sorted(f"hf-{t}" for t in types)
    families = {_registry._model_to_module.get(n, n) for n in timm.list_models()}
    names = [e.name for e in timm_entries()]
    assert len(names) == len(families)
    assert "timm-convnext-convnext_atto" in names and "timm-resnet-resnet18" in names


def test_error_class_masks_numbers_and_names() -> None:
    a = error_class("ValueError: c1.batch_norm: qparam shape changed from (1,) to (16,); 'x' bad")
    b = error_class("ValueError: c1.batch_norm: qparam shape changed from (3,) to (48,); 'y' bad")
    assert a == b == "ValueError: cN.batch_norm: qparam shape changed from (N,) to (N,); '…' bad"


def test_runner_resumes_from_its_rows_and_writes_the_table(tmp_path: Path) -> None:
    first = timm_entries()[0].name
    row = {"name": first, "failed_stage": "calibrate", "error": "IndexError: aminmax: dim 1", "wall": 3.0}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    main(["--chunk", "0/100000", "--limit", "1", "--out", str(tmp_path)])  # the one entry is done: no run
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 1
    table = (tmp_path / "RESULTS.md").read_text()
    assert f"| {first} | prepare (failed in calibrate) | IndexError: aminmax: dim N |" in table
    assert "ours end to end (verify ok): 0" in table


@pytest.mark.sweep
@pytest.mark.parametrize("name", ["timm-convnext-convnext_atto", "hf-bert", "hf-resnet", "hf-gpt2"])
def test_sweep_model_passes_end_to_end(name: str, tmp_path: Path) -> None:
    from benchmarks.sweep.run import _run_one

    row = _run_one(name, tmp_path)
    assert row["end_to_end_ok"], row
