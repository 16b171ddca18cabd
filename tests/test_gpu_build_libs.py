"""A GPU build's first load is the one llama-cpp-python itself makes: by default it runs the
libraries its wheel ships, never the separately built batch-invariant ggml-cpu (issue 41: the
door must differ from the working `llama_cpp.Llama` control as little as possible)."""

from __future__ import annotations

from pathlib import Path

from localspec.llama import libs


def _wheel(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True)
    for name in ("libllama.so", "libggml.so", "libggml-cpu.so") + names:
        (folder / name).write_bytes(b"")
    return folder


def test_a_gpu_build_loads_its_own_libraries_unless_exact_is_asked(tmp_path, monkeypatch):
    lib = _wheel(tmp_path / "llama_cpp" / "lib", "libggml-cuda.so")
    exact = _wheel(tmp_path / "llama_cpp" / libs.EXACT_DIR)
    monkeypatch.setattr(libs, "package_lib_dir", lambda: lib)
    monkeypatch.setattr(libs, "exact_lib_status", lambda environ=None: (exact, ""))
    env: dict = {}
    account = libs.choose(None, env)
    assert account.startswith("llama.cpp's own libraries (a GPU build, libggml-cuda")
    assert "LLAMA_CPP_LIB_PATH" not in env
    assert libs.choose(True, env) == f"the batch-invariant libraries in {exact}"   # --exact
    assert env["LLAMA_CPP_LIB_PATH"] == str(exact)


def test_a_cpu_build_keeps_the_batch_invariant_default(tmp_path, monkeypatch):
    lib = _wheel(tmp_path / "llama_cpp" / "lib", "libggml-rpc.so")
    exact = _wheel(tmp_path / "llama_cpp" / libs.EXACT_DIR)
    monkeypatch.setattr(libs, "package_lib_dir", lambda: lib)
    monkeypatch.setattr(libs, "exact_lib_status", lambda environ=None: (exact, ""))
    assert libs.gpu_backend(lib) == ""
    env: dict = {}
    assert libs.choose(None, env) == f"the batch-invariant libraries in {exact}"


def test_gpu_backend_names_the_backend_of_a_real_wheel_layout(tmp_path):
    lib = _wheel(tmp_path / "lib", "libggml-vulkan.so")
    (lib / "libggml-vulkan.so.0").symlink_to("libggml-vulkan.so")
    assert libs.gpu_backend(lib) == "libggml-vulkan"
    assert libs.gpu_backend(tmp_path / "missing") == ""


def test_the_cpu_library_stamp_follows_the_library_this_process_loads(tmp_path, monkeypatch):
    """The verify cost curve is cached per ggml-cpu build (policy/calibrate.curve_key): another
    patch set changes kernels without changing llama.cpp's feature line (2026-11-27: a curve
    measured before the Q6_K tile's prefetch was still believed after it)."""
    own = _wheel(tmp_path / "llama_cpp" / "lib")
    exact = _wheel(tmp_path / "llama_cpp" / libs.EXACT_DIR)
    (exact / "libggml-cpu.so").write_bytes(b"patched")
    monkeypatch.setattr(libs, "package_lib_dir", lambda: own)
    assert libs.cpu_lib_stamp({}) == "libggml-cpu.so:0:" + str(int((own / "libggml-cpu.so").stat().st_mtime))
    before = libs.cpu_lib_stamp({"LLAMA_CPP_LIB_PATH": str(exact)})
    assert before.startswith("libggml-cpu.so:7:")
    (exact / "libggml-cpu.so").write_bytes(b"patched again")      # a rebuild
    assert libs.cpu_lib_stamp({"LLAMA_CPP_LIB_PATH": str(exact)}) != before
    assert libs.cpu_lib_stamp({"LLAMA_CPP_LIB_PATH": str(tmp_path / "nowhere")}) == ""
