"""Shape glossary, used in every shape comment of this package.

    B  batch size
    S  global sequence length (the whole sequence, before sharding)
    s  local sequence length (this rank's shard, S / P)
    H  query heads
    K  key/value heads (H % K == 0; K < H is GQA, K == 1 is MQA)
    D  head dimension
    P  ring size (ranks in the sequence-parallel group)
    c  chunk length of a layout (S / P for contiguous, S / 2P for zigzag)
"""
