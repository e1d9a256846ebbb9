"""WebDataset shards: listing and counting (``listing``), reading one (``reading``), each epoch's plan over
ranks and workers (``epoch_split``), the loader's batches (``stream``), writing (``writer``)."""

from vitattn.data.shards.listing import expand_shards, shard_sizes, stats_path
from vitattn.data.shards.reading import ShardError, local_path, read_shard

__all__ = ["ShardError", "expand_shards", "local_path", "read_shard", "shard_sizes", "stats_path"]
