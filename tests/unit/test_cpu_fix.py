import torch

from draftadapt.engine.cpu_fix import expand_kernel_impl


def reference_expand(x, cu, replace_from, replace_to):
    out, start = [], 0
    for i, end in enumerate(cu.tolist()):
        v = x[i].item()
        out += [replace_to if v == replace_from else v] * (end - start)
        start = end
    return out


def test_float_values_are_expanded_in_float():
    # the bug: float temperatures were written into an int64 copy; here they land in `output`
    temps = torch.tensor([0.3, 1.0, 0.7], dtype=torch.float32)
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = torch.full((6,), float("nan"))
    expand_kernel_impl(out, temps, cu, 0, 1)
    assert out.tolist() == [torch.tensor(v).float().item() for v in reference_expand(temps, cu, 0, 1)]


def test_int_values_with_replacement_and_empty_requests():
    x = torch.tensor([4, -1, 7, -1], dtype=torch.int32)
    cu = torch.tensor([1, 1, 4, 6], dtype=torch.int64)
    out = torch.zeros(8, dtype=torch.int32)
    expand_kernel_impl(out, x, cu, -1, 9)
    assert out[:6].tolist() == reference_expand(x, cu, -1, 9) == [4, 7, 7, 7, 9, 9]
    assert out[6:].tolist() == [0, 0]  # nothing past the last request is touched


def test_llvmlite_lib_answers_vars_with_a_dict_after_the_guard():
    # vLLM's kernel-override scan calls vars() on every module attribute; llvmlite's ffi.lib
    # (loaded once numba has compiled something, as the n-gram proposer does) answered it with a
    # wrapped C function, and no in-process engine could start after an n-gram one
    from llvmlite.binding import ffi

    from draftadapt.engine.cpu_fix import guard_llvmlite_lib

    ffi.lib._fntab.pop("__dict__", None)
    assert not isinstance(vars(ffi.lib), dict)  # the failure the guard exists for
    guard_llvmlite_lib()
    assert vars(ffi.lib) == {} and vars(ffi.lib).get("kernel") is None
