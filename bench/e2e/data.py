"""Synthetic tokens a model can learn: a fixed random first-order Markov chain.

Each token has `branching` possible successors with random (fixed) probabilities. A model that learns the
transition table reaches the chain's entropy rate, far below the uniform loss ln(vocab), so the loss curve
falls visibly within tens of steps and keeps falling. The data is a pure function of (seed, step), so every
optimizer sees the same batches, and nothing is downloaded.
"""

from __future__ import annotations

import math

import torch


class MarkovTokens:
    def __init__(self, vocab_size: int, branching: int = 4, seed: int = 0) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        if not 1 <= branching <= vocab_size:
            raise ValueError(f"branching must be in [1, vocab_size], got {branching}")
        self.vocab_size = vocab_size
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        # successors[i] are the tokens that may follow token i, probs[i] their probabilities.
        self.successors = torch.stack([torch.randperm(vocab_size, generator=gen)[:branching]
                                       for _ in range(vocab_size)])
        weights = torch.rand(vocab_size, branching, generator=gen, dtype=torch.float64) + 0.1
        self.probs = weights / weights.sum(dim=1, keepdim=True)
        # Dense transition log-probabilities, for the optimal loss on a batch.
        self._logp = torch.full((vocab_size, vocab_size), -math.inf, dtype=torch.float64)
        self._logp.scatter_(1, self.successors, self.probs.log())

    def sample(self, num_sequences: int, seq_len: int, stream: int = 0) -> torch.Tensor:
        """int64 [num_sequences, seq_len + 1] tokens walked along the chain, on the CPU. Deterministic in
        (seed, stream, num_sequences, seq_len)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + stream + 1)
        tokens = torch.empty(num_sequences, seq_len + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(self.vocab_size, (num_sequences,), generator=gen)
        for t in range(seq_len):  # one vectorized draw per position, all sequences at once
            prev = tokens[:, t]
            choice = torch.multinomial(self.probs[prev], 1, generator=gen).squeeze(1)
            tokens[:, t + 1] = self.successors[prev, choice]
        return tokens

    def batches(self, steps: int, batch_size: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per training step, (inputs, targets): int64 [batch_size, seq_len] each, targets shifted by one
        token. Every optimizer trained on this list sees the same data in the same order."""
        tokens = self.sample(steps * batch_size, seq_len).view(steps, batch_size, seq_len + 1)
        return [(tokens[i, :, :-1].contiguous(), tokens[i, :, 1:].contiguous()) for i in range(steps)]

    def optimal_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The cross-entropy (nats) of the true chain on these tokens: the floor a model can reach."""
        return float(-self._logp[inputs.cpu(), targets.cpu()].mean())

    def uniform_loss(self) -> float:
        """The loss of a model that knows nothing (where training starts)."""
        return math.log(self.vocab_size)
