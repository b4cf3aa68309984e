from kernels.cpu import SIMD_FLAGS, cpu_flags, cpu_info, native_bf16


def test_cpu_info_names_the_simd_flags_this_cpu_has():
    info = cpu_info()
    assert info["model"] and info["cpus"] >= 1
    assert set(info["flags"]) <= set(SIMD_FLAGS) and set(info["flags"]) <= cpu_flags()
    assert info["flags"] == sorted(info["flags"])
    with open("/proc/cpuinfo") as f:
        raw = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    assert cpu_flags() == frozenset(raw.split(":", 1)[1].split()) if raw else not cpu_flags()


def test_native_bf16_follows_the_flags():
    assert native_bf16() == bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
