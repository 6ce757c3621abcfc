"""omni.devices: the settings applied before a model runs on a GPU."""

import torch

from omni.devices import disable_cudnn_attention


def test_disable_cudnn_attention_turns_off_only_cudnn():
    before = (
        torch.backends.cuda.cudnn_sdp_enabled(),
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.mem_efficient_sdp_enabled(),
    )
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        disable_cudnn_attention()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() == before[1]
        assert torch.backends.cuda.mem_efficient_sdp_enabled() == before[2]
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before[0])
