"""Run the prepare passes step by step on a model (tests of individual passes)."""

from __future__ import annotations

import torch
from torch import fx, nn

from coreai_opt.config import QuantizerConfig
from coreai_opt.passes.annotate import annotate
from coreai_opt.passes.capture import capture
from coreai_opt.passes.classify_ops import classify_ops
from coreai_opt.passes.fold_batchnorm import fold_batchnorm
from coreai_opt.passes.functionalize_weights import functionalize_weights
from coreai_opt.passes.insert_quantizers import insert_quantizers


def annotated(model: nn.Module, x: torch.Tensor, config: QuantizerConfig, method: str = "auto") -> fx.GraphModule:
    gm = classify_ops(capture(model, (x,), method=method)).graph_module
    gm = fold_batchnorm(functionalize_weights(gm).graph_module).graph_module
    return annotate(gm, config.resolve, int32_bias=config.int32_bias, fixed_range_outputs=config.fixed_range_outputs,
                    per_block_fallback=config.per_block_fallback).graph_module


def inserted(model: nn.Module, x: torch.Tensor, config: QuantizerConfig, method: str = "auto") -> fx.GraphModule:
    return insert_quantizers(annotated(model, x, config, method)).graph_module
