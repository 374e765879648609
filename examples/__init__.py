"""Example models shipped with pipecut, each with a factory ``build(batch_size, seed)``.

A factory returns ``(model, example_inputs, loss_fn, target)``: what ``pipecut.plan`` and
``pipecut.compile`` take.
"""

from examples import gpt, mlp, resnet

EXAMPLES = {"mlp": mlp.build, "gpt": gpt.build, "resnet": resnet.build}
"""Example factories by name: each ``build(batch_size=16, seed=0)``."""
