"""WebDataset shards, in one package: which shards a spec names and their sizes (``listing``), reading one
(``reading``, with ``tar_reader`` for plain local tars), each epoch's split of the samples over ranks and
loader workers (``epoch_split``), the loader's batches (``stream``), and writing shards (``writer``).

Captioning shards is inference: ``vitattn.inference.captioning``.
"""

from vitattn.data.shards.listing import expand_shards, shard_sizes, stats_path
from vitattn.data.shards.reading import ShardError, local_path, read_shard

__all__ = ["ShardError", "expand_shards", "local_path", "read_shard", "shard_sizes", "stats_path"]
