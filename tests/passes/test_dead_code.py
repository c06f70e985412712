"""The safe dead-code sweep deletes only nodes proven free of side effects."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import fx, nn

from coreai_opt.graph.dead_code import remove_dead_nodes
from coreai_opt.graph.op_effects import is_pure, may_alias_input


class _UnusedResults(nn.Module):
    """Every statement's result is unused; only some of them have an effect."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1.0
        y.add_(1)                      # writes into y: kept
        y.mul_(2)                      # writes into y: kept
        F.relu(y, inplace=True)        # writes into y: kept
        self.act(y)                    # nn.ReLU(inplace=True): kept
        torch.add(x, 1, out=y)         # out=: kept
        self.bn(x)                     # running statistics in train mode: kept
        self.drop(x)                   # consumes random numbers: kept
        self.fc(x)                     # pure module call: removed
        x.view(-1)                     # pure view: removed
        x.size(0)                      # pure query: removed
        _ = x + 3                      # pure: removed
        return y


def _label(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else node.target.__name__


def test_unused_in_place_and_stateful_calls_survive_and_pure_ones_go() -> None:
    gm = fx.symbolic_trace(_UnusedResults())
    removed = remove_dead_nodes(gm)
    gm.recompile()
    kept = [_label(n) for n in gm.graph.nodes if n.op != "placeholder"]
    assert removed == 4  # fc, view, size, x + 3
    assert kept == ["mul", "add_", "mul_", "relu", "act", "add", "bn", "drop", "output"]
    assert next(n for n in gm.graph.nodes if _label(n) == "add").kwargs["out"].name == "mul"


def test_sweep_keeps_the_model_output_bit_identical() -> None:
    torch.manual_seed(0)
    model = _UnusedResults().train()
    gm = fx.symbolic_trace(copy.deepcopy(model))
    remove_dead_nodes(gm)
    gm.recompile()
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.manual_seed(1)
        expected = model(x.clone())
        torch.manual_seed(1)
        got = gm(x.clone())
    assert torch.equal(got, expected)
    assert torch.equal(gm.bn.running_mean, model.bn.running_mean)  # BN statistics updated once in each


def test_a_chain_of_dead_pure_nodes_goes_in_one_sweep() -> None:
    class Chain(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            _ = torch.relu(x.view(-1) * 2).sum()
            return x

    gm = fx.symbolic_trace(Chain())
    assert remove_dead_nodes(gm) == 4
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "output"]


def test_unknown_modules_and_functions_are_not_proven_pure() -> None:
    class Custom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.custom = Custom()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.custom(x)
            print(x)  # noqa: T201 - a side effect the tables do not know
            return x

    class Leaves(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, name: str) -> bool:
            return isinstance(m, Custom) or super().is_leaf_module(m, name)

    root = Outer()
    gm = fx.GraphModule(root, Leaves().trace(root))
    nodes = {str(n.target): n for n in gm.graph.nodes}
    assert not is_pure(gm, nodes["custom"]) and may_alias_input(gm, nodes["custom"])
    assert remove_dead_nodes(gm) == 0


def test_aten_ops_follow_their_schema() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    gm = fx.symbolic_trace(M())
    x = next(iter(gm.graph.nodes))
    with gm.graph.inserting_after(x):
        add_ = gm.graph.call_function(torch.ops.aten.add_.Tensor, (x, 1))
        view = gm.graph.call_function(torch.ops.aten.view.default, (x, [-1]))
        add = gm.graph.call_function(torch.ops.aten.add.Tensor, (x, 1))
        rand = gm.graph.call_function(torch.ops.aten.rand_like.default, (x,))
    assert [is_pure(gm, n) for n in (add_, view, add, rand)] == [False, True, True, False]
    assert [may_alias_input(gm, n) for n in (view, add)] == [True, False]


def test_a_value_read_only_by_metadata_checks_goes_with_its_checks_and_a_read_value_keeps_its_check() -> None:
    """transformers' MRA on CPU: ``key.float()`` handed to an absent kernel; only the export's dtype check reads it."""

    class UnusedCast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.key, self.query = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            _ = self.key(x).float()  # dead: its checks read it, nothing computes from it
            return self.query(x).float() * 2

    from coreai_opt.passes.capture import capture

    x = torch.randn(2, 4)
    gm = capture(UnusedCast().eval(), (x,), method="export")
    checks = [n for n in gm.graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]
    assert len(checks) == 2  # the premise: one check per cast
    expected = gm(x)
    assert remove_dead_nodes(gm) > 0
    gm.recompile()
    targets = [str(n.target) for n in gm.graph.nodes]
    assert "key.weight" not in " ".join(targets) and "query.weight" in " ".join(targets), targets
    assert sum(n.target is torch.ops.aten._assert_tensor_metadata.default for n in gm.graph.nodes) == 1
    assert torch.equal(gm(x), expected)
