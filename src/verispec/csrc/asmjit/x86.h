#pragma once
namespace asmjit { namespace x86 { struct Xmm {}; struct Ymm {}; struct Zmm {}; } }
