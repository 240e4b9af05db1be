// The distributed layer without MPI (CMake did not find it): data parallelism is refused clearly.
#include "graft/distributed.h"

namespace graft {

bool mpi_available() { return false; }
bool launched_by_mpirun() { return false; }

std::unique_ptr<Communicator> mpi_communicator(int*, char***, double) {
  fail(ErrorKind::Unsupported,
       "this graft was built without MPI, so it cannot train data-parallel; install Open MPI "
       "(Debian: libopenmpi-dev openmpi-bin) and rebuild");
}

}  // namespace graft
