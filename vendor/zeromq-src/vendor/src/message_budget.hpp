/*
    dpcoord's patch to libzmq 4.3.4 (see vendor/README.md in the dpcoord
    repository). Licensed as libzmq is: LGPL v3 or later with the static
    linking exception in v2_decoder.cpp's header.
*/

#ifndef __ZMQ_MESSAGE_BUDGET_HPP_INCLUDED__
#define __ZMQ_MESSAGE_BUDGET_HPP_INCLUDED__

#include <stdint.h>

namespace zmq
{
//  ZMQ_MAXMSGSIZE for a whole message. libzmq checks each frame against
//  the limit and counts high-water marks in whole messages, so the frames
//  of a message still arriving were held without bound: a peer that sends
//  frames flagged MORE and never a last one grows the receiver's pipe for
//  ever. Here the frames of one message share the limit. Each frame before
//  the last is counted as at least frame_floor bytes (a frame occupies a
//  64-byte msg_t in the pipe, whatever its size), the last as its size, so
//  a single-frame message meets the limit exactly as before.
class message_budget_t
{
  public:
    explicit message_budget_t (int64_t max_) : _max (max_), _held (0) {}

    //  Whether a data frame of size_ bytes fits in what the frames before
    //  it in its message left; if it does it is counted, and more_ says
    //  whether frames of the same message follow it.
    bool admit (uint64_t size_, bool more_)
    {
        if (_max < 0)
            return true;
        const uint64_t max = static_cast<uint64_t> (_max);
        if (_held > max || size_ > max - _held)
            return false;
        if (!more_) {
            _held = 0;
            return true;
        }
        uint64_t counted = size_;
        if (counted < frame_floor)
            counted = frame_floor;
        _held += counted;
        return true;
    }

  private:
    static const uint64_t frame_floor = 64;

    const int64_t _max;
    //  What the frames read so far of the message in progress count for.
    uint64_t _held;
};
}

#endif
