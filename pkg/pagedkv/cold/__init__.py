"""Cold tier: KV blocks persisted to disk, restored fail-closed (docs/contracts/cold-tier.md).

A warm prefix survives a restart: full KV blocks are written as checksummed safetensors
objects under SHA-256 chain keys bound to the model fingerprint, and a new process restores
the longest verified chain instead of recomputing it. A failure is a miss, never wrong KV.
Hybrid families persist their out-of-pool state beside the blocks as sidecars, and a
restore never returns K/V without the sidecar that backs it (docs/cold.md, "Sidecars").
"""

from pagedkv.cold.backend import ColdBackend
from pagedkv.cold.capture import CaptureOutcome, CaptureStop
from pagedkv.cold.codec import BlockGeometry, DecodedBlock, block_bound, decode_block
from pagedkv.cold.digest_cache import WeightDigestCache
from pagedkv.cold.fingerprint import (
                                      WeightProvenance,
                                      cold_fingerprint,
                                      geometry_part,
                                      model_fingerprint,
                                      weight_identity,
)
from pagedkv.cold.format import DEFAULT_FORMAT, UPSTREAM_KEY_FORMAT, ColdFormat
from pagedkv.cold.grouped_restore import GroupedRestore, restore_grouped
from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.keys import cold_key_chain, sidecar_key
from pagedkv.cold.names import object_name, parse_object_name
from pagedkv.cold.policy import ColdSidecarPolicy
from pagedkv.cold.profiles import (
                                      COLD_RESTORE_FAMILIES,
                                      REFERENCE_FAMILY,
                                      FamilyColdProfile,
                                      OutOfPoolState,
                                      cold_restore_supported,
                                      family_profile,
                                      register_family_profile,
                                      resolve_persist,
)
from pagedkv.cold.recurrent_state import RecurrentStateCodec, conv_state_codec, gdn_state_codec
from pagedkv.cold.redis_store import RedisColdStore
from pagedkv.cold.restore import RestoreDecline, RestoreOutcome
from pagedkv.cold.sidecar import ColdSidecarLayout, RestoredSidecar
from pagedkv.cold.sidecar_bundle import RestoredSidecars, SidecarBundle
from pagedkv.cold.sidecar_capture import SidecarCaptureOutcome, SidecarCaptureStop
from pagedkv.cold.sliding_window import SlidingGroupRows, SlidingGroupTarget, SlidingWindowCodec
from pagedkv.cold.stats import (
                                      COLD_DELTA_FIELDS,
                                      ColdCacheStats,
                                      ColdSidecarStats,
                                      cold_sidecar_stats,
                                      record_sidecar_installed,
)
from pagedkv.cold.tier import (
                                      ColdRestore,
                                      ColdTier,
                                      ColdTierContext,
                                      cold_cache_stats,
                                      cold_tier_for_model,
                                      install_capture_budget,
)
from pagedkv.cold.tiered_store import TieredColdStore
from pagedkv.cold.trace import TurnTraceWriter
from pagedkv.cold.writer import Barrier, BlockJob, SidecarJob

__all__ = [
                                      "COLD_DELTA_FIELDS",
                                      "COLD_RESTORE_FAMILIES",
                                      "DEFAULT_FORMAT",
                                      "REFERENCE_FAMILY",
                                      "UPSTREAM_KEY_FORMAT",
                                      "Barrier",
                                      "BlockGeometry",
                                      "BlockJob",
                                      "CaptureOutcome",
                                      "CaptureStop",
                                      "ColdBackend",
                                      "ColdCacheStats",
                                      "ColdFormat",
                                      "ColdGroup",
                                      "ColdRestore",
                                      "ColdSidecarLayout",
                                      "ColdSidecarPolicy",
                                      "ColdSidecarStats",
                                      "ColdTier",
                                      "ColdTierContext",
                                      "DecodedBlock",
                                      "FamilyColdProfile",
                                      "GroupedRestore",
                                      "OutOfPoolState",
                                      "RecurrentStateCodec",
                                      "RedisColdStore",
                                      "RestoreDecline",
                                      "RestoreOutcome",
                                      "RestoredSidecar",
                                      "RestoredSidecars",
                                      "SidecarBundle",
                                      "SidecarCaptureOutcome",
                                      "SidecarCaptureStop",
                                      "SidecarJob",
                                      "SlidingGroupRows",
                                      "SlidingGroupTarget",
                                      "SlidingWindowCodec",
                                      "TieredColdStore",
                                      "TurnTraceWriter",
                                      "WeightDigestCache",
                                      "WeightProvenance",
                                      "block_bound",
                                      "cold_cache_stats",
                                      "cold_fingerprint",
                                      "cold_key_chain",
                                      "cold_restore_supported",
                                      "cold_sidecar_stats",
                                      "cold_tier_for_model",
                                      "conv_state_codec",
                                      "decode_block",
                                      "family_profile",
                                      "gdn_state_codec",
                                      "geometry_part",
                                      "install_capture_budget",
                                      "model_fingerprint",
                                      "object_name",
                                      "parse_object_name",
                                      "record_sidecar_installed",
                                      "register_family_profile",
                                      "resolve_persist",
                                      "restore_grouped",
                                      "sidecar_key",
                                      "weight_identity",
]
