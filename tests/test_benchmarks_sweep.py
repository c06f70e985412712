"""The architecture sweep (issue 30): its catalog, its generic small configs, its resumable runner and table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.sweep.catalog import (
    EOS_ID,
    PAD_ID,
    SMALL_SIZES,
    VOCAB,
    entry_named,
    hf_entries,
    shrink_config,
    timm_entries,
)
from benchmarks.sweep.run import chunk_names, error_class, expected_seconds, main


def test_shrink_config_sets_every_size_field_the_config_has() -> None:
    import transformers

    bert = shrink_config(transformers.BertConfig())
    assert (bert.hidden_size, bert.num_hidden_layers, bert.num_attention_heads, bert.intermediate_size) == \
        (32, 2, 2, 64)
    assert bert.num_labels == SMALL_SIZES["num_labels"] and bert.vocab_size == VOCAB
    resnet = shrink_config(transformers.ResNetConfig())
    assert list(resnet.hidden_sizes) == [16, 32, 64, 128] and list(resnet.depths) == [1, 1, 1, 1]
    # XLM / FlauBERT name their sizes emb_dim, n_layers, n_heads (left at 2048 x 12 layers they were 2.4 GB, and
    # the peer's quantizer could not serialise them)
    xlm = shrink_config(transformers.XLMConfig())
    assert (xlm.emb_dim, xlm.n_layers, xlm.n_heads) == (32, 2, 2)
    perceiver = shrink_config(transformers.PerceiverConfig())  # 26 self-attends of 1280-wide latents: a 272 MB file
    assert (perceiver.d_latents, perceiver.num_latents, perceiver.num_self_attends_per_block) == (32, 16, 2)
    falcon_h1 = shrink_config(transformers.AutoConfig.for_model("falcon_h1"))  # 128 SSM heads x 256 states: 8 GiB
    assert (falcon_h1.mamba_n_heads, falcon_h1.mamba_d_ssm, falcon_h1.mamba_d_state) == (4, 32, 16)
    # block repeats named apart from the layer count: xLSTM's 32 blocks and HRM's 16 layers per stack (each ran
    # out of the 600 s budget) are capped at the small layer count; Perceiver's one block stays one
    xlstm = shrink_config(transformers.AutoConfig.for_model("xlstm"))
    hrm = shrink_config(transformers.AutoConfig.for_model("hrm_text"))
    assert (xlstm.num_blocks, hrm.num_layers_per_stack, perceiver.num_blocks) == (2, 2, 1)


def test_shrink_config_keeps_derived_widths_consistent() -> None:
    import transformers

    mla = shrink_config(transformers.AutoConfig.for_model("deepseek_v3"))  # rope + no-rope head parts, low ranks
    assert (mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim, mla.kv_lora_rank) == (8, 16, 16, 16)
    assert mla.qk_head_dim == 24 and mla.n_routed_experts == 2  # recomputed by the config, not left at 192
    assert shrink_config(transformers.AutoConfig.for_model("gptj")).rotary_dim == 8  # within a head of 16
    textnet = shrink_config(transformers.AutoConfig.for_model("textnet"))  # stem width named apart from the list
    assert list(textnet.hidden_sizes) == [16, 16, 32, 64, 128] and textnet.stem_out_channels == textnet.hidden_sizes[0]
    assert shrink_config(transformers.AutoConfig.for_model("deberta")).pooler_hidden_size == 32
    assert list(shrink_config(transformers.AutoConfig.for_model("funnel")).block_sizes) == [1, 1, 1]
    gemma3 = shrink_config(transformers.AutoConfig.for_model("gemma3"))  # sub-configs shrink too
    assert gemma3.vision_config.hidden_size == 32 and gemma3.text_config.num_hidden_layers == 2
    assert len(gemma3.text_config.layer_types) == 2  # per-layer lists follow the layer count
    neo = shrink_config(transformers.AutoConfig.for_model("gpt_neo"))  # a run-length list [[pattern, repeats]]
    assert neo.attention_types == [[["global", "local"], 1]] and len(neo.attention_layers) == neo.num_layers == 2
    assert shrink_config(transformers.AutoConfig.for_model("ministral")).head_dim == 16  # unset (None) upstream


def test_shrink_config_sets_the_special_tokens_the_heads_read() -> None:
    import transformers

    gpt2 = shrink_config(transformers.GPT2Config())  # no pad token: the classifier cannot find a row's last token
    assert (gpt2.pad_token_id, gpt2.eos_token_id, gpt2.bos_token_id) == (PAD_ID, EOS_ID, 0)  # 50256 >= VOCAB
    assert shrink_config(transformers.BartConfig()).eos_token_id == EOS_ID


def test_token_inputs_end_each_row_in_one_eos_and_never_draw_pad_or_eos() -> None:
    entry = next(e for e in hf_entries() if e.name == "hf-bart")
    ids, mask = entry.inputs(torch.Generator().manual_seed(0), 8)
    lengths = mask.sum(1)
    assert ids[torch.arange(8), lengths - 1].tolist() == [EOS_ID] * 8
    assert (ids == EOS_ID).sum().item() == 8 and (ids == PAD_ID).sum().item() == 0
    assert lengths[0] == ids.shape[1]


@pytest.mark.parametrize("name", ["hf-llama", "hf-bart", "hf-xmod", "hf-funnel", "hf-deepseek_v3", "hf-gptj",
                                  "hf-textnet", "hf-falcon", "hf-esm", "hf-gpt_neo"])
def test_formerly_misconfigured_entries_build_and_run(name: str) -> None:
    """Each failed in the catalog's own setup (no pad token, no eos in the rows, no default language, block sizes,
    inconsistent head / rotary widths, a stem width, a read-only property, no vocabulary)."""
    entry = entry_named(name)
    model = entry.build()
    batch = entry.inputs(torch.Generator().manual_seed(0), 4)
    with torch.no_grad():
        out = model(*batch)
    assert out.shape[0] == 4 and torch.isfinite(out).all()


def test_smallest_timm_variant_is_chosen_by_parameter_count_and_cached(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.sweep import catalog

    monkeypatch.setattr(catalog, "timm_families", lambda: {"resnet": ["resnet50", "resnet18", "resnet34"]})
    cache = tmp_path / "choice.json"
    assert catalog.smallest_timm_variants(cache) == {"resnet": "resnet18"}  # not the first-named
    saved = json.loads(cache.read_text())["families"]["resnet"]
    assert saved["parameters"] == catalog.timm_parameters("resnet18") == 11_178_564

    def must_not_count(arch: str) -> int:
        raise AssertionError(arch)

    monkeypatch.setattr(catalog, "timm_parameters", must_not_count)
    assert catalog.smallest_timm_variants(cache) == {"resnet": "resnet18"}  # read back, not recounted


def test_entry_named_builds_one_entry_without_the_catalog() -> None:
    entry = entry_named("timm-resnet-resnet18")
    assert (entry.name, entry.family, entry.input_names) == ("timm-resnet-resnet18", "timm", ("x",))
    assert entry_named("hf-bert").input_names == ("input_ids", "attention_mask")
    with pytest.raises(KeyError, match="no sweep entry is called 'hf-nonexistent'"):
        entry_named("hf-nonexistent")


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
    assert "timm-convnext-convnext_atto_rms" in names and "timm-resnet-resnet18" in names  # fewest parameters


def test_error_class_masks_numbers_and_names() -> None:
    a = error_class("ValueError: c1.batch_norm: qparam shape changed from (1,) to (16,); 'x' bad")
    b = error_class("ValueError: c1.batch_norm: qparam shape changed from (3,) to (48,); 'y' bad")
    assert a == b == "ValueError: cN.batch_norm: qparam shape changed from (N,) to (N,); '…' bad"


def test_chunks_are_balanced_by_earlier_wall_times_longest_first(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in [
        {"name": "a", "wall": 10.0}, {"name": "b", "wall": 9.0}, {"name": "c", "wall": 700.0},
        {"name": "c", "wall": 5.0}, {"name": "d", "wall": 4.0}, {"name": "gone", "wall": 3.0}]))
    expected = expected_seconds(rows, budget=600.0)
    assert expected == {"a": 10.0, "b": 9.0, "c": 5.0, "d": 4.0, "gone": 3.0}  # the last row of a name wins
    names = ["a", "b", "c", "d", "e"]  # e has no row: the median of the known (9 s)
    # a 10 -> 0; b 9 -> 1; e 9 -> 1 (18); c 5 -> 0 (15); d 4 -> 0 (19): loads 19 / 18, by index they were 19 / 13
    assert (chunk_names(names, 0, 2, expected), chunk_names(names, 1, 2, expected)) == (["a", "c", "d"], ["b", "e"])
    assert chunk_names(names, 0, 1, expected) == names
    assert expected_seconds(tmp_path / "none.jsonl", 600.0) == {}
    assert chunk_names(names, 1, 2, {}) == ["b", "d"]  # no rows: equal weights, catalog order alternates


def test_runner_resumes_from_its_rows_and_writes_the_table(tmp_path: Path) -> None:
    first = timm_entries()[0].name
    row = {"name": first, "failed_stage": "calibrate", "error": "IndexError: aminmax: dim 1", "wall": 3.0}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    # no earlier rows to balance by: chunk 0 of 100000 is the catalog's first entry, which is done: no run
    main(["--chunk", "0/100000", "--limit", "1", "--out", str(tmp_path), "--balance-by", str(tmp_path / "none")])
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 1
    table = (tmp_path / "RESULTS.md").read_text()
    assert f"| {first} | prepare (failed in calibrate) | IndexError: aminmax: dim N |" in table
    assert "verify_onnx ok): 0/1 (0 %) of the models that built" in table
    assert "| 1 | calibrate | IndexError: aminmax: dim N | 0 |" in table


def test_failure_classes_separate_the_catalog_and_count_what_torch_cannot_export() -> None:
    from benchmarks.sweep.run import failure_classes, torch_exports

    peer_ok = {"ort_float_export": 1.0, "ort_quantize": 1.0}
    rows = [
        {"name": "a", "failed_stage": None, "verify_ok": True, "end_to_end_ok": True, "seconds": peer_ok},
        {"name": "b", "failed_stage": "build", "error": "ValueError: no pad token 1", "seconds": {"build": 0.1}},
        {"name": "c", "failed_stage": "export", "error": "Unsupported: data-dependent 3",
         "seconds": {"ort_float_export": 2.0}},  # torch's float export raised too
        {"name": "d", "failed_stage": "export", "error": "Unsupported: data-dependent 4", "seconds": peer_ok},
        {"name": "e", "failed_stage": None, "verify_ok": False, "end_to_end_ok": False, "seconds": peer_ok},
        {"name": "f", "failed_stage": "timeout", "error": "TimeoutExpired: over 420 s"},
    ]
    assert [torch_exports(r) for r in rows] == [True, None, False, True, True, None]
    assert failure_classes(rows) == [
        ("export", "Unsupported: data-dependent N", 2, 1), ("build", "ValueError: no pad token N", 1, 0),
        ("timeout", "TimeoutExpired: over N s", 1, 0), ("verify not ok", "", 1, 0)]


#: Sweep models of the default run: each under 15 s end to end on an idle core (a text encoder, a decoder whose
#: classifier needs the pad token the catalog sets, an encoder-decoder pooling at its eos token, a CNN, a mixture of
#: experts: transformers' grouped experts op and a router's tied topk).
DEFAULT_SWEEP_MODELS = ("hf-bert", "hf-llama", "hf-bart", "hf-resnet", "hf-qwen3_moe")


def _sweep_names() -> list[str]:
    from benchmarks.sweep.catalog import TIMM_CHOICE

    families = json.loads(TIMM_CHOICE.read_text())["families"]  # the cached choice: no model is built to collect
    timm_names = [f"timm-{family}-{c['arch']}" for family, c in sorted(families.items())]
    return [n for n in timm_names + [e.name for e in hf_entries()] if n not in DEFAULT_SWEEP_MODELS]


def _assert_end_to_end(name: str, tmp_path: Path) -> None:
    from benchmarks.sweep.run import _run_one

    row = _run_one(name, tmp_path)
    assert row["end_to_end_ok"], {k: row[k] for k in ("failed_stage", "error", "verify_ok", "verify_steps")}
    assert row["sqnr_ours"] > 0 and row["int_ours"] > 0  # quantized integer kernels, not a float pass-through


@pytest.mark.parametrize("name", DEFAULT_SWEEP_MODELS)
def test_default_sweep_model_passes_end_to_end(name: str, tmp_path: Path) -> None:
    _assert_end_to_end(name, tmp_path)


@pytest.mark.sweep
@pytest.mark.parametrize("name", _sweep_names())
def test_sweep_model_passes_end_to_end(name: str, tmp_path: Path) -> None:
    _assert_end_to_end(name, tmp_path)


def test_the_childs_budget_alarm_interrupts_the_running_stage_and_names_it() -> None:
    import signal
    import time

    from benchmarks.sweep.run import BudgetExceeded, failure_classes, start_budget_alarm

    def export_onnx() -> None:  # a stage function on the stack; its own except Exception must not swallow it
        started = time.monotonic()
        try:
            while time.monotonic() - started < 30:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the library's broad handlers
            pytest.fail("the alarm was caught as an Exception")

    start_budget_alarm(1)
    started = time.monotonic()
    try:
        with pytest.raises(BudgetExceeded, match="over the 1 s budget of the child in export$"):
            export_onnx()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    assert time.monotonic() - started < 10
    row = {"name": "m", "failed_stage": "timeout", "error": "BudgetExceeded: over the 400 s budget of the child in "
           "export"}
    assert failure_classes([row]) == [("timeout in export", "BudgetExceeded: over the N s budget of the child in "
                                       "export", 1, 0)]


@pytest.mark.parametrize("stage", ["ort_float_export", "export"])
def test_a_budget_running_out_in_the_peers_stages_keeps_our_row_and_in_ours_ends_it(
        stage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.corpus import runner
    from benchmarks.sweep.run import BudgetExceeded, _run_one

    def out_of_budget(*args: object, **kwargs: object) -> None:
        raise BudgetExceeded(f"over the 580 s budget of the child in {stage}", stage)

    monkeypatch.setattr(runner, "export_float" if stage == "ort_float_export" else "_ours", out_of_budget)
    name = DEFAULT_SWEEP_MODELS[0]
    if stage != "ort_float_export":
        with pytest.raises(BudgetExceeded):
            _run_one(name, tmp_path)
        return
    row = _run_one(name, tmp_path)  # ours ran to the end first: the peer's timeout is the peer's failure
    assert row["end_to_end_ok"] and row["sqnr_ours"] > 0 and row["sqnr_ort"] is None
    assert row["ort_error"] == "BudgetExceeded: over the 580 s budget of the child in ort_float_export"


def test_the_childs_memory_watch_ends_it_with_a_memory_row_naming_the_stage() -> None:
    import subprocess
    import sys

    from benchmarks.sweep.run import failure_classes

    script = ("import contextlib, io, time, torch\n"
              "from benchmarks.sweep.run import start_memory_watch\n"
              "def export_onnx():\n"
              "    hold = [torch.ones(2**24) for _ in range(16)]\n"  # 1 GiB, then wait for the watch
              "    with contextlib.redirect_stdout(io.StringIO()):\n"  # as the peer's float export (hf-flaubert)
              "        time.sleep(30)\n"
              "start_memory_watch('m', 0.5)\n"
              "export_onnx()\n"
              "print('not stopped')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    row = json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("SWEEP-ROW "))
    assert row == {"name": "m", "failed_stage": "memory",
                   "error": "MemoryExceeded: over the 0.5 GiB memory limit of the child in export"}
    assert failure_classes([row]) == [("memory in export", "MemoryExceeded: over the N GiB memory limit of the "
                                       "child in export", 1, 0)]


class _HaloLike(torch.nn.Module):
    """Runs only when its stride-32 feature map is divisible by a block of 4 (as halo attention): 128, 256, ..."""

    feature_info = [{"reduction": 32}]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert (x.shape[-1] // 32) % 4 == 0
        return x.mean((2, 3))


def test_timm_resolution_is_the_smallest_step_multiple_that_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.sweep import catalog

    assert catalog.timm_resolution("resnet18") == catalog.IMAGE == 64  # runs at the sweep's size: kept
    assert catalog.timm_resolution("deepseek_vit_412m") == 70  # patch 14: 64 does not divide, 5 x 14 does
    catalog.timm_resolution.cache_clear()
    monkeypatch.setattr(catalog, "_timm_create", lambda arch, size=64: _HaloLike())
    assert catalog.timm_resolution("resnet18") == 128  # 96 has a 3 x 3 feature map, 128 a 4 x 4
    catalog.timm_resolution.cache_clear()
    monkeypatch.setattr(_HaloLike, "forward", lambda self, x: (_ for _ in ()).throw(RuntimeError("never runs")))
    assert catalog.timm_resolution("resnet18") == 224  # no size below the default runs: the default input size
    catalog.timm_resolution.cache_clear()


def test_timm_entry_draws_images_at_its_resolution() -> None:
    entry = entry_named("timm-deepseek_vit-deepseek_vit_412m")
    (images,) = entry.inputs(torch.Generator().manual_seed(0), 2)
    assert images.shape == (2, 3, 70, 70)


def test_shrink_config_reads_and_shrinks_a_heterogeneous_per_layer_config() -> None:
    import transformers

    text = transformers.AutoConfig.for_model("dots3_note").text_config  # per_layer_config: heads per layer type
    small = shrink_config(text)
    assert small.num_hidden_layers == 2 and len(small.layer_types) == 2
    small.allow_global_per_layer_attribute_access = True
    assert (small.num_attention_heads, small.kv_lora_rank, small.qk_nope_head_dim) == (2, 16, 16)
    for layer in range(2):  # each layer's own values shrink by the same rules (64 heads, rank 1024 upstream)
        assert small.per_layer_config[layer].num_attention_heads == 2
        assert small.per_layer_config[layer].kv_lora_rank == 16


def test_shrink_config_scales_counts_of_some_layers_with_the_layer_count() -> None:
    import transformers

    text = transformers.AutoConfig.for_model("gemma3n").text_config
    assert (text.num_hidden_layers, text.num_kv_shared_layers) == (35, 15)
    small = shrink_config(text)
    assert (small.num_hidden_layers, small.num_kv_shared_layers) == (2, 0)  # 15 * 2 // 35
    assert small.kv_sharing_modes == [None, None]  # upstream raised: shared layers without a producing layer
    assert small.vocab_size == small.vocab_size_per_layer_input == VOCAB  # 262144 per-layer embedding rows


def test_a_model_class_built_on_a_sub_config_gets_that_sub_config() -> None:
    import transformers

    from benchmarks.sweep.small_config import config_for as _config_for

    composite = transformers.AutoConfig.for_model("musicgen")  # text encoder + audio encoder + decoder
    decoder = _config_for(composite, transformers.MusicgenForCausalLM.config_class)
    assert decoder is composite.decoder and type(decoder).__name__ == "MusicgenDecoderConfig"
    bert = transformers.BertConfig()
    assert _config_for(bert, transformers.BertConfig) is bert
    assert type(_config_for(bert, transformers.GPT2Config)) is transformers.GPT2Config  # none inside: the default


@pytest.mark.parametrize("name", ["hf-dots3_note", "hf-musicgen"])
def test_formerly_unbuildable_configs_build_and_run(name: str) -> None:
    """Each failed to build (a per-layer attribute read globally; a causal LM given its composite config)."""
    entry = entry_named(name)
    model = entry.build()
    batch = entry.inputs(torch.Generator().manual_seed(0), 4)  # musicgen reads rows as batch x its 4 codebooks
    with torch.no_grad():
        out = model(*batch)
    assert out.shape[0] == 4 and torch.isfinite(out).all()


def test_a_model_that_does_not_run_on_its_entrys_inputs_is_a_build_row_not_a_crash(tmp_path: Path) -> None:
    from benchmarks.corpus.models import CorpusModel
    from benchmarks.corpus.runner import run_corpus_model

    entry = CorpusModel("mismatched", "cnn", lambda: torch.nn.Linear(32, 8),
                        lambda gen, batch: (torch.randn(batch, 30, generator=gen),), ("x",), "hidden")
    row = run_corpus_model(entry, tmp_path)
    assert row.failed_stage == "build"
    assert row.error.startswith("the float model does not run on the entry's inputs: RuntimeError: mat1 and mat2")
