"""``@cr.compile`` on a method in a class body binds like a method: one compiled function per
instance, served with that instance's weights, freed with it."""

from __future__ import annotations

import gc
import weakref

import torch

import clika_runtime as cr


class Scaled(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 4)
        self.scale = scale

    @cr.compile
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def test_a_method_compiled_in_the_class_body_serves_each_instance_its_own_graph():
    a, b = Scaled(2.0).eval(), Scaled(3.0).eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(a(x), a.linear(x) * 2.0)
            torch.testing.assert_close(b(x), b.linear(x) * 3.0)
    assert a.forward is not b.forward and a.forward is a.forward
    assert a.forward.captures[0].hits == 2 and b.forward.captures[0].hits == 2
    assert isinstance(Scaled.forward, cr.CompiledFunction)  # on the class: the compiled function itself


def test_an_instance_with_a_compiled_method_is_freed():
    model = Scaled(2.0).eval()
    with torch.no_grad():
        model(torch.randn(2, 4))
        model(torch.randn(2, 4))
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None
