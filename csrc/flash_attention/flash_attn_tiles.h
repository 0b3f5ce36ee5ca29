// Tile shapes of the flash-attention kernels, sized so every block's LDS stays near 32-50 KB of the
// 64 KB a gfx90a CU has: two forward blocks fit per CU at head dim 64 and 128.
#pragma once

namespace mf_flash {

constexpr int kWaves = 4;             // wavefronts per block
constexpr int kThreads = 64 * kWaves; // 256 threads
constexpr int kBlockN = 64;           // keys per tile: one key per lane of a wavefront

// Forward: 8 (d=128) or 16 (d=64) query rows per wavefront.
// LDS at d=128: Q 32x128x2 + KV 64x130x2 + P 32x64x4 = 33 KB; at d=64: 8 + 8.4 + 16 = 32.4 KB.
template <int D>
struct FwdTile {
  static constexpr int kRowsPerWave = D == 128 ? 8 : 16;
  static constexpr int kBlockM = kRowsPerWave * kWaves;
};

// Backward: fewer query rows per tile, because K and V both stay resident in LDS.
// dK/dV kernel LDS at d=128: K, V 2x16.6 + Q, dO 2x4 + P, dS 2x4 = 49 KB.
template <int D>
struct BwdTile {
  static constexpr int kBlockM = D == 128 ? 16 : 32;
  static constexpr int kRowsPerWave = kBlockM / kWaves;
  static constexpr int kKeysPerWave = kBlockN / kWaves;  // dK/dV rows owned by one wavefront
};

}  // namespace mf_flash
