import torch
from torch import nn

from coreai_opt.api import prepare
from coreai_opt.api.algorithms.auto_quantize.recipe import _uniform_config
from coreai_opt.api.algorithms.auto_quantize.units import find_units, layer_quantizers
from coreai_opt.reference_models import BasicBlock


def test_find_units_groups_layers_reading_one_tensor_and_counts_macs_per_sample(tiny):
    model, batches = tiny
    prepared = prepare(model, _uniform_config("static"), (batches[0],))
    units = find_units(prepared)
    assert [u.names for u in units] == [("q", "k"), ("fc1",), ("fc2",)]
    assert [[layer.macs for layer in u.layers] for u in units] == [[6 * 16 * 16] * 2, [6 * 32 * 16], [6 * 8 * 32]]
    assert {u.kind for u in units} == {"linear"}


def test_layer_quantizers_lists_input_weight_and_output_quantizers(tiny):
    model, batches = tiny
    static = layer_quantizers(prepare(model, _uniform_config("static"), (batches[0],)))
    assert static == {"q": ("ln_output_fq", "q_weight_fq", "q_output_fq"),
                      "k": ("ln_output_fq", "k_weight_fq", "k_output_fq"),
                      "fc1": ("add_output_fq", "fc1_weight_fq", "fc1_output_fq"),
                      "fc2": ("act_output_fq", "fc2_weight_fq", "fc2_output_fq")}
    # dynamic quantizers only feed linears: no output quantizers
    dynamic = layer_quantizers(prepare(model, _uniform_config("dynamic"), (batches[0],)))
    assert dynamic == {name: qs[:2] for name, qs in static.items()}


def test_find_units_groups_a_resnet_block_conv_with_its_downsample():
    block = BasicBlock(8, 16, stride=2).eval()
    prepared = prepare(block, _uniform_config("static"), (torch.randn(1, 8, 8, 8),))
    names = [u.names for u in find_units(prepared)]
    assert names == [("downsample.0", "conv1"), ("conv2",)]  # graph order: the downsample is traced first
    conv1 = find_units(prepared)[0].layers[1]
    assert conv1.kind == "conv" and conv1.macs == 16 * 4 * 4 * 8 * 9  # C_out x 4 x 4 outputs x C_in x 3 x 3


def test_find_units_skips_models_without_linear_or_conv():
    prepared = prepare(nn.Sequential(nn.ReLU()).eval(), _uniform_config("static"), (torch.randn(2, 3),))
    assert find_units(prepared) == []
