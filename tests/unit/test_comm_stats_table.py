"""CollectiveCounter's op table matches the ops this torch registers at the dispatcher.

If a torch upgrade adds a collective op, or renames a schema argument, this fails and says
which entry of ``fsdp_float8.tools.comm_stats._SPECS`` to add or fix.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives  # noqa: F401  registers _c10d_functional ops

from fsdp_float8.tools import comm_stats


def _registered_ops() -> dict[str, torch._C.FunctionSchema]:
    ops = {}
    for full in torch._C._dispatch_get_all_op_names():
        namespace, _, rest = full.partition("::")
        if namespace not in comm_stats._NAMESPACES:
            continue
        name, _, overload = rest.partition(".")
        packet = getattr(getattr(torch.ops, namespace), name)
        ops[f"{namespace}::{name}"] = getattr(packet, overload or "default")._schema
    return ops


def test_every_registered_collective_is_classified():
    ops = _registered_ops()
    assert "c10d::_allgather_base_" in ops and "_c10d_functional::all_reduce" in ops
    known = comm_stats._SPECS.keys() | comm_stats._NOT_COLLECTIVES
    missing = sorted(set(ops) - known)
    assert not missing, f"add these ops to comm_stats._SPECS (or _NOT_COLLECTIVES): {missing}"


def test_spec_argument_names_exist_in_schemas():
    ops = _registered_ops()
    wrong = []
    for name, spec in comm_stats._SPECS.items():
        if name not in ops:
            continue  # not registered by this build (e.g. a backend-specific op)
        arg_names = {a.name for a in ops[name].arguments}
        if spec.input_arg is not None and spec.input_arg not in arg_names:
            wrong.append(f"{name}.input_arg={spec.input_arg!r} not in {sorted(arg_names)}")
        # the reduce op and the group are read by their namespace's names
        reducing = spec.kind in (comm_stats._K.REDUCE_SCATTER, comm_stats._K.ALL_REDUCE)
        if reducing and not arg_names & set(comm_stats._REDUCE_ARGS):
            wrong.append(f"{name} reduces but has none of {comm_stats._REDUCE_ARGS}")
        grouped = not name.startswith("c10d_functional::")  # legacy: tag + ranks
        if grouped and not arg_names & set(comm_stats._GROUP_ARGS):
            wrong.append(f"{name} has none of {comm_stats._GROUP_ARGS}")
    assert not wrong, "fix comm_stats._SPECS or its argument names:\n" + "\n".join(wrong)


def test_unused_counter_is_empty():
    counter = comm_stats.CollectiveCounter()
    with counter:
        torch.ones(3).sum()  # not a collective
    assert counter.records == [] and counter.summary() == {} and counter.count() == 0
