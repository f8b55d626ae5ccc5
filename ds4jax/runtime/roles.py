"""`Role`: which network a step runs. Always a keyword-only, static argument; never stored on objects.

| role   | network                                  | attention          | pools it owns                           |
|--------|------------------------------------------|--------------------|-----------------------------------------|
| TARGET | the full model (embed, layers, head)     | SWA + CSA + HCA    | SWA ring, C4/C128 KV, indexer KV, states |
| DRAFT  | the MTP block (shares embed and head)    | sliding window only | SWA ring only (compressed sizes are 0)  |

Because the role is static, a draft step is traced without any compressor or indexer code: a draft can
never take the compression path, whatever the runtime batch looks like.
"""

import enum


class Role(enum.Enum):
    TARGET = "target"
    DRAFT = "draft"
