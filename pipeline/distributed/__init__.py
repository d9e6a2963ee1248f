"""Running one attempt as N ranks: the world a rank lives in, and the torchrun launcher."""

from pipeline.distributed.world import CollectiveError, Groups, PeerRankError, World

__all__ = ["CollectiveError", "Groups", "PeerRankError", "World"]
