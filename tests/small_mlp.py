"""The small bf16 MLP (4 params) the engine's failure and edge-case tests
train: cheap enough for many short runs."""
import torch

BF16 = torch.bfloat16


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4)).to(BF16)


def loss_of(model, seed):
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed)).to(BF16)
    return model(x).float().pow(2).sum()
