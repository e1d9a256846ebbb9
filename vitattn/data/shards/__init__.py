"""WebDataset shards: listing, counting and reading them (``reading``), each epoch's plan over
ranks and workers (``epoch_split``), the loader's batches (``stream``), writing (``writer``)."""

from vitattn.data.shards.reading import ShardError, expand_shards, local_path, read_shard, shard_sizes

__all__ = ["ShardError", "expand_shards", "local_path", "read_shard", "shard_sizes"]
