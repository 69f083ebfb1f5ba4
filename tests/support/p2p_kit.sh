# Source after tests/support/gpu_kit.sh, from the repository root, before the p2p GPU tests (issue 18):
#     . tests/support/gpu_kit.sh || exit 1; . tests/support/p2p_kit.sh || exit 3
# Installs the carried mooncake wheel (.whl/p2p/, see tests/gpu/README.md) into /tmp/site-p2p
# and puts it on PYTHONPATH; supplies the shared libraries its engine.so needs that this machine
# lacks, into /tmp/p2p-libs on LD_LIBRARY_PATH: libcudart.so.12 from the carried
# nvidia-cuda-runtime-cu12 wheel, libibverbs/libnl/libnuma from .whl/p2p/lib, and a libcurl
# stand-in built here (tests/support/p2p_libcurl_stub.c: the P2P handshake never calls libcurl). Then
# it proves that mooncake's TCP transport moves host memory between two processes
# (tests/support/p2p_tcp_probe.py). Whatever fails prints one "p2p_kit: BLOCKED: ..." line.

p2p_kit_main() {
    p2p_src="$(pwd)/.whl/p2p"
    p2p_site=/tmp/site-p2p
    p2p_libs=/tmp/p2p-libs
    set -- "$p2p_src"/mooncake_transfer_engine-*.whl
    if [ ! -f "$1" ]; then
        echo "p2p_kit: BLOCKED: no mooncake wheel in $p2p_src (tests/gpu/README.md, 'p2p')" >&2
        return 1
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$p2p_site" "$1" || { echo "p2p_kit: BLOCKED: pip could not install $1" >&2; return 1; }
    export PYTHONPATH="$p2p_site${PYTHONPATH:+:$PYTHONPATH}"
    mkdir -p "$p2p_libs"
    export LD_LIBRARY_PATH="$p2p_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    engine_so="$p2p_site/mooncake/engine.so"

    # Each round supplies what ldd reports missing; a supplied library may need others.
    for _round in 1 2 3 4; do
        missing=$(ldd "$engine_so" 2>/dev/null | awk '/not found/ {print $1}' | sort -u)
        [ -z "$missing" ] && break
        for lib in $missing; do
            case "$lib" in
            libcudart.so.12)
                set -- "$p2p_src"/nvidia_cuda_runtime_cu12-*.whl
                [ -f "$1" ] && python3 -c 'import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    open(sys.argv[2], "wb").write(z.read("nvidia/cuda_runtime/lib/libcudart.so.12"))' \
                    "$1" "$p2p_libs/libcudart.so.12"
                ;;
            libcurl.so.4)
                echo 'CURL_OPENSSL_4 { global: curl_*; local: *; };' >"$p2p_libs/curl.map"
                cc -shared -fPIC -O2 -Wl,--version-script="$p2p_libs/curl.map" \
                    -Wl,-soname,libcurl.so.4 -o "$p2p_libs/libcurl.so.4" tests/support/p2p_libcurl_stub.c
                ;;
            *)
                [ -f "$p2p_src/lib/$lib" ] && cp "$p2p_src/lib/$lib" "$p2p_libs/"
                ;;
            esac
            [ -f "$p2p_libs/$lib" ] && echo "p2p_kit: supplied $lib (the machine has none)"
        done
    done
    missing=$(ldd "$engine_so" 2>/dev/null | awk '/not found/ {print $1}' | sort -u | tr '\n' ' ')
    if [ -n "$missing" ]; then
        echo "p2p_kit: BLOCKED: mooncake's engine.so needs libraries this machine lacks: $missing" >&2
        return 1
    fi
    if ! err=$(python3 -c 'import mooncake.engine' 2>&1); then
        echo "p2p_kit: BLOCKED: import mooncake.engine failed: $(echo "$err" | tail -1)" >&2
        return 1
    fi
    if ! probe=$(timeout 120 python3 tests/support/p2p_tcp_probe.py --mib 256 2>/tmp/p2p-probe.log); then
        echo "p2p_kit: BLOCKED: mooncake's TCP transport did not move host memory here:" \
            "$probe $(grep -E '^[EF][0-9]' /tmp/p2p-probe.log | tail -2)" >&2
        return 1
    fi
    P2P_PROBE=$probe
    export P2P_PROBE
    echo "p2p_kit: mooncake $(python3 -c 'import importlib.metadata as m; print(m.version("mooncake-transfer-engine"))'), TCP probe: $probe"
}

p2p_kit_main
