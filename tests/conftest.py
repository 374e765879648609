"""Shared test set-up: one intra-op thread (ranks are forked; OpenMP must not be live in the parent)."""

import torch

torch.set_num_threads(1)
