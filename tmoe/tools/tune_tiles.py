"""The tile candidates the tuner times, as (block_n, block_k, num_warps, num_stages)."""

# (block_n, block_k, num_warps, num_stages); up GEMM tiles load 2 * block_n weight rows
SMALL_TILES = [(32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3),
               (128, 64, 4, 5), (16, 256, 4, 3), (32, 128, 2, 5)]
LARGE_TILES = [(64, 64, 4, 4), (128, 64, 4, 4), (128, 64, 8, 4), (128, 128, 8, 3), (256, 64, 8, 3),
               (64, 128, 4, 3), (128, 64, 8, 5), (256, 64, 8, 4),
               # three stages of 96 KB at block_m 128, so two programs share an SM and one's loads
               # overlap the other's MMAs
               (64, 64, 4, 3), (64, 64, 8, 3), (128, 64, 4, 3)]
# fp8: a K tile of 128 bytes or more; block quantization caps block_k at the 128 group
FP8_SMALL_TILES = [(32, 128, 4, 4), (64, 128, 4, 4), (128, 128, 4, 3), (128, 128, 4, 4), (32, 256, 4, 3),
                   (64, 256, 4, 3), (16, 256, 4, 4)]
FP8_LARGE_TILES = [(64, 128, 4, 4), (64, 128, 8, 4), (128, 128, 8, 3), (128, 128, 8, 4), (256, 128, 8, 3),
                   (128, 64, 8, 4)]
# the decode path's down GEMM: one program per (token, block_n columns), so narrow tiles
DIRECT_DOWN_TILES = [(16, 128, 4, 4), (16, 256, 4, 3), (16, 256, 4, 4), (16, 128, 4, 6), (32, 128, 4, 4),
                     (32, 128, 4, 5), (32, 256, 4, 3), (64, 128, 4, 4)]
# low-bit: K steps over two 128 groups (scales and zero points applied in the PTX unpacking on sm_90)
LOW_BIT_SMALL_TILES = [(128, 256, 4, 3)]
LOW_BIT_LARGE_TILES = [(64, 256, 4, 3)]
