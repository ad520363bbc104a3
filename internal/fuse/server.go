// Package fuse decodes the FUSE requests a virtio-fs guest places in a
// request's readable buffers, calls the FileSystem, and encodes the replies
// into the request's writable buffers. It sees requests only as bufvec
// cursors, so it knows nothing of rings or vhost-user.
//
// Every length the guest states is checked against what the chain really
// holds; names must be NUL-terminated within the request. Errors are
// answered with an errno, never a panic. Each goroutine serving a ring has
// its own Queue with preallocated scratch space, so READ, WRITE and GETATTR
// allocate nothing and no lock is shared by the queues on the request path.
//
// What the server knows of each opcode (sizes, names, whether it replies,
// how it is scheduled, its handler) is one entry of the table in opcode.go.
package fuse

import (
	"context"
	"encoding/binary"
	"log/slog"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// Sizes of the fixed headers.
const (
	InHeaderSize  = 40
	OutHeaderSize = 16
)

// Protocol versions.
const (
	KernelVersion = 7
	// KernelMinor is the newest minor version the server speaks; it
	// answers min(client, KernelMinor). What each minor after 7.38
	// brought, and what the server does with it: init.go (allowedCaps).
	KernelMinor = 45
	// MinKernelMinor is the oldest client minor version accepted.
	MinKernelMinor = 27
)

// Defaults for ServerOptions.
const (
	DefaultMaxWrite            = 1 << 20
	DefaultMaxPages            = 256
	DefaultMaxBackground       = 0xffff
	DefaultCongestionThreshold = 0xffff / 4 * 3
)

// ServerOptions tune the INIT reply. Zero fields take the defaults.
type ServerOptions struct {
	// MaxWrite is the largest WRITE accepted (default 1 MiB).
	MaxWrite uint32
	// MaxPages is the request size in pages offered with FUSE_MAX_PAGES
	// (default 256; the guest clamps it to its queue size).
	MaxPages uint16
	// MaxBackground and CongestionThreshold bound the guest's
	// background requests (defaults as the Rust virtiofsd).
	MaxBackground       uint16
	CongestionThreshold uint16
	// Metrics counts requests per opcode for WriteMetrics.
	Metrics bool
}

func (o *ServerOptions) defaults() {
	if o.MaxWrite == 0 {
		o.MaxWrite = DefaultMaxWrite
	}
	if o.MaxPages == 0 {
		o.MaxPages = DefaultMaxPages
	}
	if o.MaxBackground == 0 {
		o.MaxBackground = DefaultMaxBackground
	}
	if o.CongestionThreshold == 0 {
		o.CongestionThreshold = DefaultCongestionThreshold
	}
}

// session is what INIT negotiated (or LoadState restored). It is replaced,
// never modified, so the queues read it with one atomic load.
type session struct {
	minor        uint32
	caps         uint64 // gofuse.CAP_* bits, flags | flags2<<32
	maxWrite     uint32 // told to the guest
	maxPages     uint16 // told to the guest with CAP_MAX_PAGES, else 0
	maxReadahead uint32 // the guest's, echoed
	window       uint64 // the DAX window's size, 0 without (dax.go)
}

// Server serves FUSE requests for one virtio-fs device.
type Server struct {
	fs    FileSystem
	opts  ServerOptions
	log   *slog.Logger
	debug bool

	// sess is nil before INIT and after DESTROY.
	sess atomic.Pointer[session]
	// mu serialises INIT, DESTROY, SaveState and LoadState and guards
	// stats (never taken on other requests).
	mu    sync.Mutex
	stats []*queueStats // one per Queue, with ServerOptions.Metrics
}

// NewServer returns a server that calls fs and logs to log.
func NewServer(fs FileSystem, opts ServerOptions, log *slog.Logger) *Server {
	opts.defaults()
	return &Server{fs: fs, opts: opts, log: log, debug: log.Enabled(context.Background(), slog.LevelDebug)}
}

// Queue serves requests for one goroutine serving ring index (the back end
// makes one per such goroutine, so a ring has several); it owns that
// goroutine's scratch space. Its Serve must not be called concurrently.
type Queue struct {
	s     *Server
	index int

	req  request  // the request's header and fixed arguments
	sess *session // the session the request is served in (not for INIT)
	// name and name2 are the request's names (readNames), copies in names.
	name, name2 []byte
	// groups are the supplementary groups the request's extensions
	// carry (in groupBuf), nil without any.
	groups   []uint32
	groupBuf [MaxGroups]uint32
	// secctx is the security context a creation request carries
	// (secctx.go), nil without one; secBody and secBuf hold it.
	secctx  *SecCtx
	secSeen bool
	secBody SecCtx
	secBuf  []byte
	// ranges are a REMOVEMAPPING's entries, decoded (dax.go).
	ranges *[MaxRemoveMappings]MapRange

	// rbuf is the out header, then a fixed reply's payload, which the file
	// system fills in place as a go-fuse struct: [0]uint64 aligns it.
	_      [0]uint64
	rbuf   [replyBufSize]byte
	n      int  // the reply payload's length
	direct bool // the reply payload was written straight into out

	names  []byte // copies of names (and SETXATTR values)
	dbuf   []byte // GETXATTR/LISTXATTR/READLINK replies not contiguous in out
	rd     dirEncoder
	forget [16]byte
	warned uint64      // rate limit for warnings
	st     *queueStats // nil with metrics off
}

// replyBufSize holds the largest fixed-size reply (fuse_statx_out, 288 B);
// smallReply all but CREATE's and STATX's.
const (
	replyBufSize = 512
	smallReply   = entryOutSize
)

// Queue returns a request handler for ring index. The back end asks for one
// per goroutine that serves the ring.
func (s *Server) Queue(index int) *Queue {
	q := &Queue{s: s, index: index, names: make([]byte, 0, initialNameBuf), st: s.newStats()}
	q.rd.init(q)
	return q
}

// noReply marks requests that are answered with nothing.
const noReply = syscall.Errno(^uintptr(0))

// Serve handles one request and returns the number of reply bytes written
// into out (0 for requests that get no reply or cannot be answered).
func (q *Queue) Serve(in, out *bufvec.Vec) uint32 {
	var start time.Time
	if q.s.debug || q.st != nil {
		start = time.Now()
	}
	h := &q.req.InHeader
	if err := in.ReadFull(unsafe.Slice((*byte)(unsafe.Pointer(h)), InHeaderSize)); err != nil {
		if q.rateLimit() {
			q.s.log.Warn("request without a complete fuse_in_header", "queue", q.index, "readable", in.Size(), "err", err)
		}
		return 0
	}
	op := lookup(h.Opcode)
	errno := q.dispatch(op, in, out)
	var written uint32
	if errno != noReply {
		written = q.reply(out, errno)
	}
	if q.st != nil {
		q.st.record(h.Opcode, op.flags, errno, time.Since(start), q.moved(op, errno))
	}
	if q.s.debug {
		e := -int32(errno)
		if errno == noReply {
			e = 0
		}
		attrs := []any{"queue", q.index, "unique", h.Unique, "opcode", OpName(h.Opcode),
			"nodeid", h.NodeId, "len", h.Length, "error", e, "latency", time.Since(start)}
		if entry := q.entryGiven(op, errno); entry != 0 {
			// The node id handed out: with nodeid, every id the guest
			// can hold appears in the log (READDIRPLUS's aside).
			attrs = append(attrs, "entry", entry)
		}
		q.s.log.Debug("fuse request", attrs...)
	}
	return written
}

// dispatch serves the request in q.req, of opcode entry op, and returns its
// answer: 0 (the payload's length in q.n), an errno, or noReply.
func (q *Queue) dispatch(op *opcode, in, out *bufvec.Vec) syscall.Errno {
	q.n, q.direct = 0, false
	errno := q.decode(op, in, out)
	if errno == 0 {
		errno = op.serve(q, in, out)
	}
	if op.flags&silent != 0 {
		return noReply
	}
	return errno
}

// decode does what every opcode needs before its handler: it checks the
// request's length and extensions, that there is room for a reply and a
// session, reads the fixed arguments and the names, and checks the room for
// a fixed reply payload, which it zeroes.
func (q *Queue) decode(op *opcode, in, out *bufvec.Vec) syscall.Errno {
	h := &q.req.InHeader
	q.groups, q.secctx = nil, nil
	if int(h.Length) != in.Size() {
		// The header's length must describe exactly what the chain
		// holds.
		return syscall.EINVAL
	}
	if h.TotalExtlen != 0 {
		if errno := q.extensions(in); errno != 0 {
			return errno
		}
	}
	if out.Size() < OutHeaderSize && op.flags&silent == 0 {
		if q.rateLimit() {
			q.s.log.Warn("request without room for a reply", "queue", q.index, "unique", h.Unique,
				"opcode", OpName(h.Opcode), "writable", out.Size())
		}
		return noReply
	}
	if op.flags&startsSession == 0 {
		if q.sess = q.s.sess.Load(); q.sess == nil {
			return syscall.EIO
		}
	}
	if op.serve == nil || op.flags&needsWindow != 0 && q.sess.window == 0 {
		return syscall.ENOSYS
	}
	n := int(op.in)
	if op.inFor != nil {
		n = op.inFor(q, in)
	}
	if errno := q.readArgs(in, n); errno != 0 {
		return errno
	}
	if op.names != noNames {
		if errno := q.readNames(in, op.names); errno != 0 {
			return errno
		}
	}
	if op.out != 0 {
		if !room(out, int(op.out)) {
			return syscall.EINVAL
		}
		q.n = int(op.out)
		if q.n <= smallReply {
			// A few stores, where clear of a length known only now is a call.
			*(*[smallReply]byte)(q.rbuf[OutHeaderSize:]) = [smallReply]byte{}
		} else {
			clear(q.rbuf[OutHeaderSize : OutHeaderSize+q.n])
		}
	}
	return 0
}

// entryGiven is the node id a successful request handed the guest (an
// opcode that givesNode), 0 for other requests.
func (q *Queue) entryGiven(op *opcode, errno syscall.Errno) uint64 {
	if errno != 0 || op.flags&givesNode == 0 {
		return 0
	}
	return replyOf[gofuse.EntryOut](q).NodeId
}

// moved is the file data a served READ or WRITE moved: the READ reply's
// payload, the count in the WRITE reply.
func (q *Queue) moved(op *opcode, errno syscall.Errno) int {
	switch {
	case errno != 0:
		return 0
	case op.flags&readsFile != 0:
		return q.n
	case op.flags&writesFile != 0:
		return int(replyOf[gofuse.WriteOut](q).Size)
	}
	return 0
}

// reply writes the out header and, on success, the payload of q.n bytes
// (already in out when q.direct, else in q.rbuf after the header). It
// returns the reply's size, or 0 when the writable part cannot hold it.
func (q *Queue) reply(out *bufvec.Vec, errno syscall.Errno) uint32 {
	n := q.n
	if errno != 0 {
		n = 0
	}
	total := OutHeaderSize + n
	binary.LittleEndian.PutUint32(q.rbuf[0:], uint32(total))
	binary.LittleEndian.PutUint32(q.rbuf[4:], uint32(-int32(errno)))
	binary.LittleEndian.PutUint64(q.rbuf[8:], q.req.Unique)
	var err error
	if q.direct && errno == 0 {
		err = out.WriteAt(q.rbuf[:OutHeaderSize], 0)
	} else if err = out.Seek(0); err == nil {
		err = out.WriteFull(q.rbuf[:total])
	}
	if err != nil {
		if q.rateLimit() {
			q.s.log.Warn("no room for the reply", "queue", q.index, "unique", q.req.Unique,
				"opcode", OpName(q.req.Opcode), "reply", total, "writable", out.Size(), "err", err)
		}
		return 0
	}
	return uint32(total)
}

// rateLimit reports whether to log the next warning: the 1st, 2nd, 4th,
// 8th... so a hostile guest cannot flood the log.
func (q *Queue) rateLimit() bool {
	q.warned++
	return q.warned&(q.warned-1) == 0
}

// heavyBytes is the size from which a READ or WRITE is worth a second
// core: below it the syscall costs about as much as waking another server,
// and serving it on the current one keeps small I/O on one core.
const heavyBytes = 32 << 10

// Classify tells the ring's servers how to schedule the request in (not yet
// consumed), from its opcode's entry: heavy for a large READ or WRITE, and
// for a large WRITE the node it writes, so writes to one file are not
// served side by side only to contend for its lock; slow for a
// storageBound request, so replies already pushed are not held back behind
// it. It only peeks: the cursor is left at the start, and Serve validates
// everything again.
func (q *Queue) Classify(in *bufvec.Vec) (heavy bool, writeNode uint64, slow bool) {
	var b [InHeaderSize + 24]byte // fuse_in_header, then fh, offset, size
	defer in.Rewind()
	if in.Pos() != 0 || in.ReadFull(b[:InHeaderSize]) != nil {
		return false, 0, false
	}
	flags := lookup(binary.LittleEndian.Uint32(b[4:])).flags
	switch {
	case flags&storageBound != 0:
		return false, 0, true
	case flags&writesFile != 0:
		// The data follows the arguments: the header's length tells.
		if binary.LittleEndian.Uint32(b[0:]) >= heavyBytes {
			return true, binary.LittleEndian.Uint64(b[16:]), false // nodeid
		}
	case flags&readsFile != 0:
		if in.ReadFull(b[InHeaderSize:]) != nil {
			return false, 0, false
		}
		return binary.LittleEndian.Uint32(b[InHeaderSize+16:]) >= heavyBytes, 0, false
	}
	return false, 0, false
}
