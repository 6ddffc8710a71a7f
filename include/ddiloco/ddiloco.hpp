// ddiloco/ddiloco.hpp: umbrella header. Includes every core header (standard
// library only). Optional integrations are included on their own:
// <ddiloco/adapters/eigen.hpp>, <ddiloco/adapters/xtensor.hpp>.
#pragma once

#include <ddiloco/clock.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/layout.hpp>
#include <ddiloco/tensor.hpp>
