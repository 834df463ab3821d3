"""Taps (lmtrace/taps.py) behave like torch forward hooks, without putting the module on the slow path."""

from __future__ import annotations

import torch

from lmtrace.capture.taps import tap


class Double(torch.nn.Module):
    def forward(self, x):
        return 2 * x


def test_tap_sees_output_and_replaces_it_and_removal_restores_the_class_forward():
    m = Double()
    seen = []
    h1 = tap(m, lambda mod, args, kwargs, out: seen.append((args[0].item(), out.item())))
    h2 = tap(m, lambda mod, args, kwargs, out: out + 1)
    assert m(torch.tensor(3.0)).item() == 7.0 and seen == [(3.0, 6.0)]
    assert not m._forward_hooks and not m._forward_pre_hooks  # the fast call path
    h1.remove()
    h1.remove()  # twice is harmless, as for torch handles
    assert m(torch.tensor(1.0)).item() == 3.0 and len(seen) == 1
    h2.remove()
    assert "forward" not in m.__dict__ and m(torch.tensor(1.0)).item() == 2.0


def test_prepended_editing_tap_runs_before_a_recording_tap_added_earlier():
    """The probes' taps are added before an intervention's; the intervention's edit must be what they see."""
    m = Double()
    recorded = []
    record = tap(m, lambda mod, args, kwargs, out: recorded.append(out.item()))
    edit = tap(m, lambda mod, args, kwargs, out: torch.zeros_like(out), prepend=True)
    assert m(torch.tensor(5.0)).item() == 0.0 and recorded == [0.0]
    edit.remove()
    record.remove()


def test_tap_sees_inputs_edited_by_a_torch_pre_hook():
    m = Double()
    seen = []
    h = tap(m, lambda mod, args, kwargs, out: seen.append(args[0].item()))
    pre = m.register_forward_pre_hook(lambda mod, args: (args[0] + 10,))
    assert m(torch.tensor(1.0)).item() == 22.0 and seen == [11.0]
    pre.remove()
    h.remove()


def test_an_instance_level_forward_is_restored():
    m = Double()
    own = lambda x: 3 * x  # noqa: E731 - e.g. accelerate replaces module.forward on the instance
    m.forward = own
    h = tap(m, lambda mod, args, kwargs, out: out + 1)
    assert m(torch.tensor(1.0)).item() == 4.0
    h.remove()
    assert m.forward is own
