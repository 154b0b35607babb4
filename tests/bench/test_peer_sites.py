"""bench/peer_sites.py: what an unpacked site directory keeps (the resolving and downloading need
PyPI, and are run by hand: docs/trainer.md "The peers on the device")."""

from bench.peer_sites import DEVICE_PYTHON, SITES, trim


def test_trim_keeps_torchs_cuda_library_of_bitsandbytes_links_pyarrows_copies_drops_tests(
        tmp_path):
    files = ["bitsandbytes/libbitsandbytes_cuda130.so", "bitsandbytes/libbitsandbytes_cpu.so",
             "bitsandbytes/libbitsandbytes_cuda126.so", "bitsandbytes/libbitsandbytes_rocm64.so",
             "pyarrow/libarrow_python.so.2600.1.0", "pyarrow/libarrow_python.so.2600",
             "pyarrow/libarrow_python.so", "pyarrow/libarrow_flight.so.2600",
             "pyarrow/include/arrow/api.h", "pandas/tests/test_x.py", "studio/app.js",
             "unsloth/__init__.py"]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(name.encode())
    trim(tmp_path)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if not p.is_dir())
    assert left == ["bitsandbytes/libbitsandbytes_cpu.so",
                    "bitsandbytes/libbitsandbytes_cuda130.so", "pyarrow/libarrow_python.so",
                    "pyarrow/libarrow_python.so.2600", "pyarrow/libarrow_python.so.2600.1.0",
                    "unsloth/__init__.py"]
    link = tmp_path / "pyarrow/libarrow_python.so"
    assert link.is_symlink() and link.read_bytes() == b"pyarrow/libarrow_python.so.2600.1.0"


def test_each_archive_keeps_only_packages_the_device_lacks():
    device = {"torch", "triton", "transformers", "peft", "accelerate", "numpy", "tokenizers",
              "safetensors", "huggingface-hub"}
    for requirements, directories in SITES.values():
        assert requirements
        for keep in directories.values():
            assert keep and not keep & device
    assert DEVICE_PYTHON[:2] == ["--python-version", "3.12"]


def test_an_archive_past_the_part_size_splits_into_parts_that_join_to_it(tmp_path):
    from bench.peer_sites import split
    data = bytes(range(256)) * 41
    small = tmp_path / "small.tar.xz"
    small.write_bytes(data[:100])
    assert split(small, part_bytes=100) == [small]
    whole = tmp_path / "fa4-site.tar.xz"
    whole.write_bytes(data)
    parts = split(whole, part_bytes=4096)
    assert [p.name for p in parts] == [f"fa4-site.tar.xz.{i:02d}" for i in range(3)]
    assert not whole.exists()
    assert all(p.stat().st_size <= 4096 for p in parts)
    assert b"".join(p.read_bytes() for p in sorted(parts)) == data
