"""distfn.fsdp_state: the optimizer-state layouts (names for torch's sharded state dicts, indices in the file,
as a bare optimizer writes them). Gathering and scattering run on 2 ranks in tests/test_fsdp.py."""

from __future__ import annotations

import torch
from torch import nn

from distfn.fsdp_state import indexed_optimizer_state, named_optimizer_state


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.blocks = nn.Sequential(nn.Sequential(nn.Linear(64, 64)), nn.Sequential(nn.Linear(64, 64)))
        self.out = nn.Linear(64, 4)


def test_optimizer_state_names_and_indices_round_trip() -> None:
    net = Net()
    opt = torch.optim.Adam([{"params": list(net.blocks.parameters()), "lr": 0.1},
                            {"params": [*net.inp.parameters(), *net.out.parameters()]}])
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    plain = opt.state_dict()
    named = named_optimizer_state(plain, opt, net)
    assert named["param_groups"][0]["params"][0] == "blocks.0.0.weight"
    assert sorted(named["state"]) == sorted(n for n, _ in net.named_parameters())
    assert named["state"]["inp.weight"]["exp_avg"] is plain["state"][4]["exp_avg"]
    back = indexed_optimizer_state(named)
    assert back["param_groups"] == plain["param_groups"]
    assert back["state"].keys() == plain["state"].keys()
    assert all(back["state"][i]["exp_avg"] is plain["state"][i]["exp_avg"] for i in plain["state"])
