#include "model/config.h"
