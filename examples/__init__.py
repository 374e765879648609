"""Example models shipped with pipecut, each with a factory ``build(batch_size, seed)``.

A factory returns ``(model, example_inputs, loss_fn, target)``: what ``pipecut.plan`` and
``pipecut.compile`` take.
"""
