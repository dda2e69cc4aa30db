"""The execution machinery under the decoding algorithm: compiled verification and heads steps on a reused static
cache (`compiled`), the C++ compiler options and GEMM template prefetch they are built with (`inlining`,
`prefetch`), grouped-query attention read in place (`attention`), the int8 heads kernel (`int8_heads`,
`csrc/int8_heads.cpp`) and the measured cost tables (`cost`). It makes no decoding decision."""
