// Package fuse decodes the FUSE requests a virtio-fs guest places in a
// request's readable buffers and encodes the replies into its writable
// buffers. It sees requests only as bufvec cursors, so it knows nothing of
// rings or vhost-user.
//
// This first version decodes and validates the request header of every
// request and answers ENOSYS (FORGET and BATCH_FORGET get no reply, as the
// protocol says); the file system operations arrive with the passthrough
// layer.
package fuse

import (
	"context"
	"encoding/binary"
	"log/slog"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// Sizes of the fixed headers.
const (
	InHeaderSize  = 40
	OutHeaderSize = 16
)

// InHeader is struct fuse_in_header.
type InHeader struct {
	Len         uint32
	Opcode      uint32
	Unique      uint64
	NodeID      uint64
	UID         uint32
	GID         uint32
	PID         uint32
	TotalExtlen uint16
}

func (h *InHeader) decode(b *[InHeaderSize]byte) {
	h.Len = binary.LittleEndian.Uint32(b[0:])
	h.Opcode = binary.LittleEndian.Uint32(b[4:])
	h.Unique = binary.LittleEndian.Uint64(b[8:])
	h.NodeID = binary.LittleEndian.Uint64(b[16:])
	h.UID = binary.LittleEndian.Uint32(b[24:])
	h.GID = binary.LittleEndian.Uint32(b[28:])
	h.PID = binary.LittleEndian.Uint32(b[32:])
	h.TotalExtlen = binary.LittleEndian.Uint16(b[36:])
}

// Server serves FUSE requests.
type Server struct {
	log   *slog.Logger
	debug bool
}

// NewServer returns a server logging to log.
func NewServer(log *slog.Logger) *Server {
	return &Server{log: log, debug: log.Enabled(context.Background(), slog.LevelDebug)}
}

// Queue is the per-ring request handler; it owns the ring's scratch space.
type Queue struct {
	s     *Server
	index int
	hdr   [InHeaderSize]byte
	out   [OutHeaderSize]byte
}

// Queue returns the handler for ring index.
func (s *Server) Queue(index int) *Queue { return &Queue{s: s, index: index} }

// Serve handles one request and returns the number of reply bytes written.
func (q *Queue) Serve(in, out *bufvec.Vec) uint32 {
	var start time.Time
	if q.s.debug {
		start = time.Now()
	}
	if err := in.ReadFull(q.hdr[:]); err != nil {
		q.s.log.Warn("request without a complete fuse_in_header", "queue", q.index, "readable", in.Size(), "err", err)
		return 0
	}
	var h InHeader
	h.decode(&q.hdr)
	errno := q.dispatch(&h, in, out)
	var n uint32
	if errno != noReply {
		n = q.reply(&h, out, errno)
	}
	if q.s.debug {
		q.s.log.Debug("fuse request", "queue", q.index, "unique", h.Unique, "opcode", OpName(h.Opcode),
			"nodeid", h.NodeID, "len", h.Len, "error", -int32(errno), "latency", time.Since(start))
	}
	return n
}

// noReply marks requests that are answered with nothing.
const noReply = unix.Errno(^uintptr(0))

func (q *Queue) dispatch(h *InHeader, in, out *bufvec.Vec) unix.Errno {
	if int(h.Len) != in.Size() {
		// The header's length must describe exactly what the chain holds.
		if h.Opcode == OpForget || h.Opcode == OpBatchForget {
			return noReply
		}
		return unix.EINVAL
	}
	switch h.Opcode {
	case OpForget, OpBatchForget:
		return noReply
	}
	return unix.ENOSYS
}

// reply writes an error-only reply (fuse_out_header) and returns its size,
// or 0 when the writable part cannot hold it.
func (q *Queue) reply(h *InHeader, out *bufvec.Vec, errno unix.Errno) uint32 {
	binary.LittleEndian.PutUint32(q.out[0:], OutHeaderSize)
	binary.LittleEndian.PutUint32(q.out[4:], uint32(-int32(errno)))
	binary.LittleEndian.PutUint64(q.out[8:], h.Unique)
	if err := out.WriteFull(q.out[:]); err != nil {
		q.s.log.Warn("no room for the reply header", "queue", q.index, "unique", h.Unique, "writable", out.Size())
		return 0
	}
	return OutHeaderSize
}
