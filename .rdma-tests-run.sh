set -u; rc=0
export RDMA_REQUIRED=1 RUST_BACKTRACE=1
rdma link 2>/dev/null; ibv_devices 2>/dev/null
echo "==> conformance-a03dcbcced114338"
/work/main/target/release/deps/conformance-a03dcbcced114338 --test-threads=1 rail || rc=1
echo "==> conformance-a03dcbcced114338 (two rails per node)"
RDMA_CONFORMANCE_RAILS=2 /work/main/target/release/deps/conformance-a03dcbcced114338 --test-threads=1 rail || rc=1
echo "==> notify-9fac1740353d6ae2"
/work/main/target/release/deps/notify-9fac1740353d6ae2 --test-threads=1 rail || rc=1
echo "==> rails-1af3a08edd499e13"
/work/main/target/release/deps/rails-1af3a08edd499e13 --test-threads=1 rail || rc=1
echo "==> rdma-640fe2ace99cdba7"
/work/main/target/release/deps/rdma-640fe2ace99cdba7 --test-threads=1 rail || rc=1
echo "==> transport_rdma-77eb6bcf6536d715"
/work/main/target/release/deps/transport_rdma-77eb6bcf6536d715 --test-threads=1 rail || rc=1
exit $rc
