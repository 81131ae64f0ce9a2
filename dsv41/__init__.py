"""dsv41: a torch.compile backend for DeepSeek-V4.1 decode on NVIDIA Hopper."""

__version__ = "0.1.0"
