# Sourced by the run scripts: use Debian's OpenBLAS under mlx[cpu] when present
# (identical results, far faster matmuls than the wheel's reference BLAS).
openblas=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
if [[ "$(uname -s)" == "Linux" && -e "$openblas" ]]; then
    export LD_PRELOAD="$openblas${LD_PRELOAD:+:$LD_PRELOAD}"
fi
