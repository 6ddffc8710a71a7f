// ddiloco/ddiloco.hpp: umbrella header. Includes every core header (standard
// library only). Optional integrations are included on their own:
// <ddiloco/adapters/eigen.hpp>, <ddiloco/adapters/xtensor.hpp>, <ddiloco/transport/zmq.hpp> (libzmq),
// <ddiloco/reference/*.hpp> (Eigen), and the testing helpers <ddiloco/testing.hpp>.
#pragma once

#include <ddiloco/checkpoint.hpp>
#include <ddiloco/clock.hpp>
#include <ddiloco/codec.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/fault_tape.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/layout.hpp>
#include <ddiloco/local_cluster.hpp>
#include <ddiloco/merge.hpp>
#include <ddiloco/merge_weights.hpp>
#include <ddiloco/message.hpp>
#include <ddiloco/outer_loop.hpp>
#include <ddiloco/outer_optimizer.hpp>
#include <ddiloco/quorum.hpp>
#include <ddiloco/schedule.hpp>
#include <ddiloco/shard_map.hpp>
#include <ddiloco/syncer.hpp>
#include <ddiloco/syncer_runtime.hpp>
#include <ddiloco/tensor.hpp>
#include <ddiloco/tensor_list.hpp>
#include <ddiloco/transport/in_process.hpp>
#include <ddiloco/transport/sharded.hpp>
#include <ddiloco/version.hpp>
#include <ddiloco/wire.hpp>
