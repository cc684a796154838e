"""The build and loader (offload_adam/_build.py, offload_adam/_sources.py).

Each load runs in a subprocess, because the loader caches the module per process
and the point is what a fresh process prints and raises. A full compile takes
about a minute on 2 cores, so the suite compiles at most once: every test reuses
the default build cache (shared with the other test files), and the rebuild test
copies it and deletes one object file.
"""

import json
import os
import re
import select
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from offload_adam import _sources

REPO = Path(__file__).resolve().parent.parent
CSRC = REPO / "csrc"
COMPILE_LINE = re.compile(r"^offload_adam: compiling CPU kernels \((?:first use|out of date), ~\d+ s\) into (.+)$", re.M)

# Prelude of every child: the JIT path only, even where a prebuilt offload_adam._C exists.
NO_AOT = "import sys; sys.modules['offload_adam._C'] = None\n"


def run_child(code, env=None, cwd=None):
    """Runs `code` in a fresh interpreter; returns (returncode, stdout, stderr)."""
    full_env = dict(os.environ)
    full_env.pop("OFFLOAD_ADAM_ISA", None)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(cwd or REPO), os.environ.get("PYTHONPATH")]))
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", NO_AOT + textwrap.dedent(code)], env=full_env,
                          cwd=cwd or REPO, capture_output=True, text=True, timeout=900)
    return proc.returncode, proc.stdout, proc.stderr


LOAD_AND_PRINT_PATH = """
    from offload_adam._build import load_kernels
    K = load_kernels()
    print(K.__file__)
    print(K.isa())
"""


@pytest.fixture(scope="module")
def built_module_path():
    """Path of the JIT-built module in the default cache (built here if cold)."""
    rc, out, err = run_child(LOAD_AND_PRINT_PATH)
    assert rc == 0, err
    assert len(COMPILE_LINE.findall(err)) <= 1, err
    return Path(out.splitlines()[0])



# A child that loads the kernels and prints a RuntimeError instead of dying of it.
LOAD_REPORTING_RUNTIME_ERROR = """
    from offload_adam._build import load_kernels
    try:
        load_kernels()
    except RuntimeError as e:
        print("RuntimeError:", e)
"""

TABLE = _sources.KernelTable.read(CSRC)
STAMP = "offload_adam.finished"   # a finished build's mark (_build.py)


def test_sources_table_matches_csrc():
    for name in [*TABLE.sources, _sources.BINDING_SOURCE]:
        assert (CSRC / name).is_file(), name
    # Every .cpp but the binding is a kernel file of the table.
    assert {p.name for p in CSRC.glob("*.cpp")} == {*TABLE.sources, _sources.BINDING_SOURCE}
    assert _sources.find_csrc(REPO / "offload_adam") == CSRC
    hashed = {p.name for p in _sources.hashed_files(CSRC)}
    assert {p.name for p in CSRC.glob("*.h")} | {_sources.TABLE_FILE} <= hashed
    assert _sources.TABLE_FILE in (REPO / "MANIFEST.in").read_text()


def test_flags_never_target_the_build_machine():
    for name in TABLE.sources:
        for machine in ("x86_64", "aarch64", "riscv64"):
            flags = TABLE.flags(name, machine)
            assert not any(f.startswith(("-mtune", "-mcpu")) or "native" in f for f in flags), flags
            # -march only where a unit needs the baseline plus one named extension
            assert all(f == "-march=armv8-a+crc" for f in flags if f.startswith("-march")), flags
            assert "-ffp-contract=off" in flags and "-std=c++17" in flags
    assert "-mavx2" in TABLE.flags("isa_avx2.cpp", "x86_64")
    assert "-mavx512f" in TABLE.flags("isa_avx512.cpp", "AMD64")
    # NEON is baseline on aarch64: its unit needs no flag there (nor anywhere else).
    assert TABLE.flags("isa_neon.cpp", "aarch64") == TABLE.flags("adam_driver.cpp", "aarch64")
    # The CRC32 extension (optional in ARMv8.0) in its own unit, called after HWCAP_CRC32.
    assert TABLE.flags("crc32c_armv8.cpp", "aarch64")[-1] == "-march=armv8-a+crc"
    assert TABLE.flags("crc32c_armv8.cpp", "x86_64") == TABLE.flags("adam_driver.cpp", "x86_64")
    # Off x86 the ISA files are compiled without ISA flags (their #if guards empty them).
    for machine in ("aarch64", "arm64", "riscv64"):
        assert not any(f.startswith("-mavx") for f in TABLE.flags("isa_avx512.cpp", machine))


def test_table_rows_are_checked():
    table = _sources.KernelTable("* any -O2\n# a comment\n\na.cpp x86_64 -mfoo  # trailing\nb.cpp any\n")
    assert table.sources == ["a.cpp", "b.cpp"]
    assert table.flags("a.cpp", "x86_64")[-1] == "-mfoo" and "-mfoo" not in table.flags("a.cpp", "aarch64")
    assert table.flags("b.cpp", "aarch64") == ["-O2", *_sources.BUILD_FLAGS]
    with pytest.raises(ValueError, match=r"t\.txt:1: expected"):
        _sources.KernelTable("lonely.cpp\n", "t.txt")
    with pytest.raises(ValueError, match="listed twice"):
        _sources.KernelTable("a.cpp any\na.cpp any\n")


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_cmake_compiles_what_the_table_says(machine, tmp_path):
    # CMake reads the same table; its compile commands (configure only, the host
    # compiler standing in for a cross one) carry exactly the table's flags.
    cmake = (REPO / "CMakeLists.txt").read_text()
    assert not any(name in cmake for name in TABLE.sources) and "-mavx" not in cmake
    proc = subprocess.run(["cmake", "-S", str(REPO), "-B", str(tmp_path), "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
                           "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_SYSTEM_NAME=Linux",
                           f"-DCMAKE_SYSTEM_PROCESSOR={machine}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    commands = json.loads((tmp_path / "compile_commands.json").read_text())
    compiled = {Path(c["file"]).name: c["command"].split() for c in commands}
    for name in TABLE.sources:
        want = [f for f in TABLE.flags(name, machine) if f not in ("-fPIC", "-pthread")]
        args = compiled[name]
        assert all(f in args for f in want), (name, want, args)
        extra = {f for f in args if f.startswith("-m") or f.startswith("--param")} - set(want)
        assert not extra, (name, extra)


def test_second_load_is_cached_and_silent(built_module_path):
    rc, out, err = run_child(LOAD_AND_PRINT_PATH)
    assert rc == 0, err
    assert err == ""
    assert Path(out.splitlines()[0]) == built_module_path


def test_missing_object_rebuilds_and_prints_one_line(built_module_path, tmp_path):
    # A copy of the cache as a build stopped midway leaves it (no stamp, one kernel
    # object gone): only that file recompiles.
    build_dir = tmp_path / built_module_path.parent.name
    shutil.copytree(built_module_path.parent, build_dir)
    (build_dir / "kernels" / "thread_pool.o").unlink()
    (build_dir / STAMP).unlink()
    rc, out, err = run_child(LOAD_AND_PRINT_PATH, env={"TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert rc == 0, err
    assert COMPILE_LINE.findall(err) == [str(build_dir)], err
    assert err.count("\n") == 1, err
    assert (build_dir / "kernels" / "thread_pool.o").is_file()
    assert Path(out.splitlines()[0]).parent == build_dir


def test_a_cache_folder_relative_and_with_a_space_links(built_module_path, tmp_path):
    # TORCH_EXTENSIONS_DIR="ext dir": relative (as "~/ext" quoted is) and with a space.
    # torch links in the build folder from flags it writes as they are, so the kernel
    # objects, named by their path from the cache, were not found (relative) or split in
    # two (the space), on every run. (A copy of a build without its module and stamp.)
    cwd = tmp_path / "work"
    cache = cwd / "ext dir"
    build_dir = cache / built_module_path.parent.name
    shutil.copytree(built_module_path.parent, build_dir)
    (build_dir / built_module_path.name).unlink()
    (build_dir / STAMP).unlink()
    given = "ext dir"
    rc, out, err = run_child(LOAD_AND_PRINT_PATH + "    import offload_adam, torch\n"
                             "    p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.ones(4)\n"
                             "    offload_adam.AdamW([p], lr=0.5, weight_decay=0.0).step(); print(p.tolist())\n",
                             env={"TORCH_EXTENSIONS_DIR": given}, cwd=cwd)
    assert rc == 0, err
    assert Path(out.splitlines()[0]).parent == build_dir
    assert (build_dir / built_module_path.name).is_file()
    assert out.splitlines()[-1] == "[0.5, 0.5, 0.5, 0.5]", out


def test_any_rebuild_prints_the_line(built_module_path, tmp_path):
    # The binding's object newer than the module: torch's ninja relinks it. Every
    # compile or link says so, not only the first.
    build_dir = tmp_path / built_module_path.parent.name
    shutil.copytree(built_module_path.parent, build_dir)
    module = build_dir / built_module_path.name
    built = module.stat().st_mtime
    os.utime(build_dir / "binding.o", (built + 1, built + 1))   # (copytree kept the times)
    (build_dir / STAMP).unlink()   # (a finished build is not asked to ninja: below)
    rc, out, err = run_child(LOAD_AND_PRINT_PATH, env={"TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert rc == 0, err
    assert COMPILE_LINE.findall(err) == [str(build_dir)], err
    assert module.stat().st_mtime > built + 1    # it did relink
    rc, out, err = run_child(LOAD_AND_PRINT_PATH, env={"TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert rc == 0 and err == "", err


def test_sources_rewritten_unchanged_reuse_the_finished_build(built_module_path, tmp_path):
    # A reinstall (pip writes every file anew) or a checkout that leaves a source as it
    # was gives it a new time, not new contents: the finished build, named after
    # the contents, is imported without a compile (ninja would compare times and rebuild).
    build_dir = tmp_path / built_module_path.parent.name
    shutil.copytree(built_module_path.parent, build_dir)
    sources = sorted(p for p in CSRC.iterdir() if p.is_file())
    times = [(p, p.stat()) for p in sources]
    try:
        for p in sources:
            os.utime(p)   # now: newer than every object of the build
        rc, out, err = run_child(LOAD_AND_PRINT_PATH, env={"TORCH_EXTENSIONS_DIR": str(tmp_path)})
    finally:
        for p, st in times:
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert rc == 0 and err == "", err
    assert Path(out.splitlines()[0]) == build_dir / built_module_path.name


def test_a_finished_build_loads_where_there_is_no_compiler(built_module_path, tmp_path):
    # A machine without a compiler (a compute node) sharing the cache of one that had
    # it loads that build; with nothing built, the error says what to install, and
    # leaves no empty build folder behind.
    cache = tmp_path / "cache"
    shutil.copytree(built_module_path.parent, cache / built_module_path.parent.name)
    bare = {"TORCH_EXTENSIONS_DIR": str(cache), "PATH": str(tmp_path / "empty")}
    rc, out, err = run_child(LOAD_AND_PRINT_PATH, env=bare)
    assert rc == 0 and err == "", err
    assert Path(out.splitlines()[0]) == cache / built_module_path.parent.name / built_module_path.name
    empty = tmp_path / "nothing"
    rc, out, err = run_child(LOAD_REPORTING_RUNTIME_ERROR, env={**bare, "TORCH_EXTENSIONS_DIR": str(empty)})
    assert rc == 0, err
    assert "RuntimeError:" in out and "compiler 'c++' was not found" in out, out
    assert not empty.exists() or not list(empty.iterdir())


def test_two_environments_with_the_same_torch_keep_a_build_each(built_module_path, tmp_path):
    # A second environment with the same torch version installed elsewhere (here:
    # the same torch reached through a symlink, so its headers and libraries have
    # other paths, as in a second venv): it builds into a folder of its own, once,
    # and switching back and forth rebuilds nothing.
    cache = tmp_path / "cache"
    shutil.copytree(built_module_path.parent, cache / built_module_path.parent.name)
    other = tmp_path / "other-env"
    other.mkdir()
    import torch
    (other / "torch").symlink_to(Path(torch.__file__).parent, target_is_directory=True)
    here = {"TORCH_EXTENSIONS_DIR": str(cache)}
    there = {**here, "PYTHONPATH": os.pathsep.join([str(other), str(REPO)])}
    rc, out, err = run_child(LOAD_AND_PRINT_PATH, env=there)
    assert rc == 0, err
    assert len(COMPILE_LINE.findall(err)) == 1, err
    built_there = Path(out.splitlines()[0])
    assert built_there.parent != cache / built_module_path.parent.name
    for env, module in ((here, cache / built_module_path.parent.name / built_module_path.name),
                        (there, built_there), (here, None)):
        rc, out, err = run_child(LOAD_AND_PRINT_PATH, env=env)
        assert rc == 0 and err == "", err   # cached and silent
        if module is not None:
            assert Path(out.splitlines()[0]) == module


def test_missing_ninja_is_a_clear_error_before_compiling(tmp_path):
    rc, out, err = run_child("""
        import shutil, sys
        real_which = shutil.which
        shutil.which = lambda cmd, *a, **k: None if cmd == "ninja" else real_which(cmd, *a, **k)
        sys.modules["ninja"] = None   # the pip package is gone too
        from offload_adam._build import load_kernels
        try:
            load_kernels()
        except RuntimeError as e:
            print("RuntimeError:", e)
    """, env={"TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert rc == 0, err
    assert "RuntimeError:" in out and "pip install ninja" in out, out
    assert not COMPILE_LINE.search(err), err
    assert not list(tmp_path.rglob("*.o"))


def test_missing_compiler_is_a_clear_error(tmp_path):
    rc, out, err = run_child(LOAD_REPORTING_RUNTIME_ERROR, env={"TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "/nonexistent/bin/g++"})
    assert rc == 0, err
    assert "RuntimeError:" in out and "apt-get install g++" in out and "/nonexistent/bin/g++" in out, out


def private_loader(tmp_path):
    """A private copy of the loader (an offload_adam package of its own) and of the
    sources beside it, under tmp_path/tree: returns the package folder."""
    pkg = tmp_path / "tree" / "offload_adam"
    pkg.mkdir(parents=True)
    for name in ("_build.py", "_sources.py"):
        shutil.copy(REPO / "offload_adam" / name, pkg / name)
    (pkg / "__init__.py").write_text("")
    shutil.copytree(CSRC, pkg.parent / "csrc")
    return pkg


def test_compile_error_raises_runtime_error_with_compiler_output(tmp_path):
    # A private copy of the loader and sources with one broken kernel file; the
    # failure comes from the kernel objects, before the slow torch binding.
    pkg = private_loader(tmp_path)
    (pkg.parent / "csrc" / "thread_pool.cpp").write_text("this is not C++;\n")
    rc, out, err = run_child(LOAD_REPORTING_RUNTIME_ERROR, env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "MAX_JOBS": "1"}, cwd=pkg.parent)
    assert rc == 0, err
    assert "RuntimeError:" in out and "thread_pool.cpp" in out and "error" in out, out


def test_env_isa_bogus_is_a_value_error_naming_the_choices(built_module_path):
    rc, out, err = run_child("""
        from offload_adam._build import load_kernels
        try:
            load_kernels()
        except ValueError as e:
            print("ValueError:", e)
    """, env={"OFFLOAD_ADAM_ISA": "bogus"})
    assert rc == 0, err
    assert "ValueError:" in out and "bogus" in out, out
    assert all(isa in out.split("expects", 1)[1] for isa in ("avx512", "avx2", "neon", "scalar", "auto")), out


def test_env_isa_selects_the_variant(built_module_path):
    rc, out, err = run_child(LOAD_AND_PRINT_PATH, env={"OFFLOAD_ADAM_ISA": "scalar"})
    assert rc == 0, err
    assert out.splitlines()[1] == "scalar"
    rc, out, err = run_child(LOAD_AND_PRINT_PATH, env={"OFFLOAD_ADAM_ISA": " Scalar\n"})
    assert rc == 0 and out.splitlines()[1] == "scalar", err   # as a shell may leave it


def test_env_isa_this_cpu_lacks_names_the_variable(built_module_path):
    import platform
    lacking = "avx512" if platform.machine() in ("aarch64", "arm64") else "neon"
    rc, out, err = run_child(LOAD_REPORTING_RUNTIME_ERROR, env={"OFFLOAD_ADAM_ISA": lacking})
    assert rc == 0, err
    assert "RuntimeError:" in out and f"OFFLOAD_ADAM_ISA='{lacking}'" in out, out


def test_load_kernels_is_cached_in_process():
    from offload_adam._build import load_kernels

    assert load_kernels() is load_kernels()


def test_a_prebuilt_extension_from_other_sources_is_not_used(tmp_path):
    # An ahead-of-time build in an editable install stays beside the sources; once they
    # are edited it is stale: the loader warns and builds just in time instead of
    # running the old binary without a word. Here a stand-in _C (a Python module) and
    # the digest that setup.py writes beside a real one.
    pkg = private_loader(tmp_path)
    (pkg / "_C.py").write_text("PREBUILT = True\n")
    digest = pkg / _sources.AOT_DIGEST_FILE
    code = """
        import sys, warnings
        del sys.modules["offload_adam._C"]   # (run_child's prelude hides it)
        from offload_adam._build import _import_ahead_of_time
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = _import_ahead_of_time()
        print(getattr(module, "PREBUILT", None))
        print(" | ".join(str(w.message) for w in caught))
    """
    for written, used in ((None, True), (_sources.sources_digest(pkg.parent / "csrc"), True),
                          ("0" * 64, False)):
        if written is not None:
            digest.write_text(written)
        rc, out, err = run_child(code, cwd=pkg.parent)
        assert rc == 0, err
        prebuilt, warned = out.splitlines()[0], "\n".join(out.splitlines()[1:])
        assert prebuilt == ("True" if used else "None"), (written, out)
        assert ("was built from other C++ sources" in warned) != used, warned


def test_a_cache_folder_that_cannot_be_written_is_named(tmp_path):
    # (a file where a folder should be: refused even to root, unlike permissions)
    (tmp_path / "afile").write_text("")
    rc, out, err = run_child(LOAD_AND_PRINT_PATH,
                             env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "afile" / "sub")})
    assert rc != 0
    assert "RuntimeError: offload_adam: cannot write the kernels' build folder" in err, err
    assert "TORCH_EXTENSIONS_DIR" in err, err


def test_a_build_waiting_on_another_says_so(built_module_path, tmp_path):
    # Another process holds the build folder's lock (its first compile takes a minute):
    # the second says on stderr that it waits, then finds the build and loads it.
    import fcntl
    build_dir = tmp_path / built_module_path.parent.name
    shutil.copytree(built_module_path.parent, build_dir)
    (build_dir / STAMP).unlink()   # (a finished build is imported without the lock)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    env.pop("OFFLOAD_ADAM_ISA", None)
    with open(build_dir / "offload_adam.lock", "a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        child = subprocess.Popen([sys.executable, "-c", NO_AOT + textwrap.dedent(LOAD_AND_PRINT_PATH)],
                                 env=env, cwd=REPO, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        # (until the child writes a line, or a minute: a child waiting in silence fails)
        ready, _, _ = select.select([child.stderr], [], [], 60)
        line = child.stderr.readline() if ready else ""
        assert line.startswith("offload_adam: waiting for another process's build of the "
                               f"kernels in {build_dir}"), line
        assert child.poll() is None   # still waiting while the lock is held
    out, err = child.communicate(timeout=900)
    assert child.returncode == 0, err
    assert Path(out.splitlines()[0]).parent == build_dir


def test_a_child_forked_while_the_kernels_load_takes_the_lock(kernels):
    """A child forked while another thread of its parent held the kernels' load lock
    (its first step, loading them) inherited the lock held by a thread it does not have,
    and its first step waited for good (found from outside). The child's lock is its own."""
    import threading
    import time
    import warnings
    from offload_adam import _build
    held, release = threading.Event(), threading.Event()

    def hold():
        with _build._lock:
            held.set()
            release.wait()
    thread = threading.Thread(target=hold)
    thread.start()
    held.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # (3.12: fork with threads)
        pid = os.fork()
    if pid == 0:   # the child: the module loaded, under a lock no thread holds
        free = _build._lock.acquire(timeout=5)
        if free:
            _build._lock.release()
        os._exit(0 if free and _build.load_kernels() is not None else 1)
    release.set()
    thread.join()
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if not done:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done and os.waitstatus_to_exitcode(status) == 0
