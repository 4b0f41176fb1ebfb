#pragma once
// Minimal stand-in: FBGEMM's public headers include asmjit only for register types used by its
// JIT code generators, which this extension never touches.
#define ASMJIT_LIBRARY_MAKE_VERSION(major, minor, patch) ((major << 16) | (minor << 8) | (patch))
#define ASMJIT_LIBRARY_VERSION 0
#define ASMJIT_INLINE_NODEBUG inline
