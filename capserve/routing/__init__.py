"""Routing between capsule layers: the paper's inverted dot-product attention, and its two comparison
systems, dynamic routing and EM routing. One module per algorithm, each with its maths, its capsule layers and its
training loss; ``blocks`` (bounded memory) and ``fused`` (the compiled CPU kernel) serve attention routing.
"""

from __future__ import annotations

from capserve.routing.attention import (  # noqa: F401
    CapsuleLayer,
    Normalize,
    PrimaryCapsules,
    cross_entropy_loss,
    group_children,
    parents_layout,
    pose_norm,
    routing_step,
    uniform_conv_step,
    uniform_step,
)
from capserve.routing.blocks import VOTE_BLOCK_BYTES, block_rows, vote_blocks  # noqa: F401
from capserve.routing.dynamic import (  # noqa: F401  # noqa: F401
    ABSENT_WEIGHT,
    MARGIN_ABSENT,
    MARGIN_PRESENT,
    DynamicCapsuleLayer,
    Squash,
    SquashedPrimaryCapsules,
    dynamic_routing,
    margin_loss,
    squash,
)
from capserve.routing.em import (  # noqa: F401
    EM_BLOCK_BYTES,
    EM_COST_SCALE,
    EM_FINAL_LAMBDA,
    EM_SHARE_EPS,
    EM_VARIANCE_FLOOR,
    SPREAD_MARGIN,
    EMCapsuleLayer,
    EMPrimaryCapsules,
    coordinate_offsets,
    em_e_step,
    em_inverse_temperature,
    em_m_step,
    em_route,
    em_routing,
    em_votes,
    spread_loss,
    spread_margin,
)
from capserve.routing.fused import FUSED_BLOCK_BYTES, FUSED_MAX_ROW, FUSED_MIN_PARENTS, FUSED_MIN_VOTES, fused_block  # noqa: F401
from capserve.routing.losses import LOSSES, Loss, training_loss  # noqa: F401
