"""hfai's `hfai.distributed.fsdp.warp` (sic), where hfai code imports its auto-wrap policies:

from titanlite.compat.hfai.warp import size_based_auto_wrap_policy  # was: hfai.distributed.fsdp.warp
"""

from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

__all__ = ["size_based_auto_wrap_policy", "transformer_auto_wrap_policy"]
