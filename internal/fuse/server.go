// Package fuse decodes the FUSE requests a virtio-fs guest places in a
// request's readable buffers, calls the FileSystem, and encodes the replies
// into the request's writable buffers. It sees requests only as bufvec
// cursors, so it knows nothing of rings or vhost-user.
//
// Every length the guest states is checked against what the chain really
// holds; names must be NUL-terminated within the request. Errors are
// answered with an errno, never a panic. Each ring has its own Queue with
// preallocated scratch space, so READ, WRITE and GETATTR allocate nothing and
// no lock is shared by the queues on the request path.
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
	// answers min(client, KernelMinor).
	KernelMinor = 38
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

// Queue is the per-ring request handler; it owns the ring's scratch space.
// Its Serve must not be called concurrently.
type Queue struct {
	s     *Server
	index int

	h      gofuse.InHeader
	rbuf   [replyBufSize]byte // out header + small reply payload
	direct bool               // the reply payload was written straight into out
	a      args               // decoded request arguments
	o      outs               // reply structs the file system fills in
	names  []byte             // copies of names (and SETXATTR values)
	dbuf   []byte             // GETXATTR/LISTXATTR/READLINK replies not contiguous in out
	rd     dirEncoder
	forget [16]byte
	warned uint64      // rate limit for warnings
	st     *queueStats // nil with metrics off
	// group is the supplementary group the request's extensions carry,
	// NoGroup without one.
	group uint32
}

// replyBufSize holds the largest fixed-size reply (fuse_statx_out, 288 B).
const replyBufSize = 512

type args struct {
	init     gofuse.InitIn
	forget   gofuse.ForgetIn
	getattr  gofuse.GetAttrIn
	setattr  gofuse.SetAttrIn
	mknod    gofuse.MknodIn
	mkdir    gofuse.MkdirIn
	rename   gofuse.RenameIn
	link     gofuse.LinkIn
	open     gofuse.OpenIn
	create   gofuse.CreateIn
	read     gofuse.ReadIn
	write    gofuse.WriteIn
	release  gofuse.ReleaseIn
	fsync    gofuse.FsyncIn
	flush    gofuse.FlushIn
	setxattr gofuse.SetXAttrIn
	getxattr gofuse.GetXAttrIn
	lk       gofuse.LkIn
	access   gofuse.AccessIn
	falloc   gofuse.FallocateIn
	lseek    gofuse.LseekIn
	copy     gofuse.CopyFileRangeIn
	statx    gofuse.StatxIn
}

type outs struct {
	entry  gofuse.EntryOut
	attr   gofuse.AttrOut
	open   gofuse.OpenOut
	create gofuse.CreateOut
	statfs gofuse.StatfsOut
	lk     gofuse.LkOut
	lseek  gofuse.LseekOut
	statx  gofuse.StatxOut
	init   gofuse.InitOut
}

// Queue returns the handler for ring index.
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
	hb := unsafe.Slice((*byte)(unsafe.Pointer(&q.h)), InHeaderSize)
	if err := in.ReadFull(hb); err != nil {
		if q.rateLimit() {
			q.s.log.Warn("request without a complete fuse_in_header", "queue", q.index, "readable", in.Size(), "err", err)
		}
		return 0
	}
	q.direct = false
	n, errno := q.dispatch(in, out)
	var written uint32
	if errno != noReply {
		written = q.reply(out, n, errno)
	}
	if q.st != nil {
		q.st.record(q.h.Opcode, errno, time.Since(start), q.moved(n, errno))
	}
	if q.s.debug {
		e := -int32(errno)
		if errno == noReply {
			e = 0
		}
		attrs := []any{"queue", q.index, "unique", q.h.Unique, "opcode", OpName(q.h.Opcode),
			"nodeid", q.h.NodeId, "len", q.h.Length, "error", e, "latency", time.Since(start)}
		if entry := q.entryGiven(errno); entry != 0 {
			// The node id handed out: with nodeid, every id the guest
			// can hold appears in the log (READDIRPLUS's aside).
			attrs = append(attrs, "entry", entry)
		}
		q.s.log.Debug("fuse request", attrs...)
	}
	return written
}

// entryGiven is the node id a successful request handed the guest (LOOKUP,
// MKNOD, MKDIR, SYMLINK, LINK, CREATE, TMPFILE), 0 for other requests.
func (q *Queue) entryGiven(errno syscall.Errno) uint64 {
	if errno != 0 {
		return 0
	}
	switch q.h.Opcode {
	case OpLookup, OpMknod, OpMkdir, OpSymlink, OpLink:
		return q.o.entry.NodeId
	case OpCreate, OpTmpfile:
		return q.o.create.NodeId
	}
	return 0
}

// moved is the data a served READ or WRITE moved: the READ reply's payload,
// the count in the WRITE reply.
func (q *Queue) moved(n int, errno syscall.Errno) int {
	if errno != 0 {
		return 0
	}
	switch q.h.Opcode {
	case OpRead:
		return n
	case OpWrite:
		return int(binary.LittleEndian.Uint32(q.rbuf[OutHeaderSize:]))
	}
	return 0
}

// reply writes the out header and, on success, the payload of n bytes
// (already in out when q.direct, else in q.rbuf after the header). It
// returns the reply's size, or 0 when the writable part cannot hold it.
func (q *Queue) reply(out *bufvec.Vec, n int, errno syscall.Errno) uint32 {
	if errno != 0 {
		n = 0
	}
	total := OutHeaderSize + n
	binary.LittleEndian.PutUint32(q.rbuf[0:], uint32(total))
	binary.LittleEndian.PutUint32(q.rbuf[4:], uint32(-int32(errno)))
	binary.LittleEndian.PutUint64(q.rbuf[8:], q.h.Unique)
	var err error
	if q.direct && errno == 0 {
		err = out.WriteAt(q.rbuf[:OutHeaderSize], 0)
	} else if err = out.Seek(0); err == nil {
		err = out.WriteFull(q.rbuf[:total])
	}
	if err != nil {
		if q.rateLimit() {
			q.s.log.Warn("no room for the reply", "queue", q.index, "unique", q.h.Unique,
				"opcode", OpName(q.h.Opcode), "reply", total, "writable", out.Size(), "err", err)
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

// noReplyOp reports whether op is answered with nothing.
func noReplyOp(op uint32) bool {
	switch op {
	case OpForget, OpBatchForget, OpInterrupt, OpNotifyReply:
		return true
	}
	return false
}

func (q *Queue) dispatch(in, out *bufvec.Vec) (int, syscall.Errno) {
	h := &q.h
	q.group = NoGroup
	if int(h.Length) != in.Size() {
		// The header's length must describe exactly what the chain
		// holds.
		if noReplyOp(h.Opcode) {
			return 0, noReply
		}
		return 0, syscall.EINVAL
	}
	if h.TotalExtlen != 0 {
		if errno := q.extensions(in); errno != 0 {
			if noReplyOp(h.Opcode) {
				return 0, noReply
			}
			return 0, errno
		}
	}
	if out.Size() < OutHeaderSize && !noReplyOp(h.Opcode) {
		if q.rateLimit() {
			q.s.log.Warn("request without room for a reply", "queue", q.index, "unique", h.Unique,
				"opcode", OpName(h.Opcode), "writable", out.Size())
		}
		return 0, noReply
	}
	if h.Opcode == OpInit {
		return q.doInit(in, out)
	}
	sess := q.s.sess.Load()
	if sess == nil {
		if noReplyOp(h.Opcode) {
			return 0, noReply
		}
		return 0, syscall.EIO
	}
	switch h.Opcode {
	case OpRead:
		return q.doRead(in, out)
	case OpWrite:
		return q.doWrite(in, out, sess)
	case OpGetattr:
		return q.doGetattr(in, out)
	case OpLookup:
		return q.doLookup(in, out)
	case OpForget:
		return q.doForget(in)
	case OpBatchForget:
		return q.doBatchForget(in)
	case OpSetattr:
		return q.doSetattr(in, out)
	case OpReadlink:
		return q.doReadlink(out)
	case OpSymlink:
		return q.doSymlink(in, out)
	case OpMknod:
		return q.doMknod(in, out)
	case OpMkdir:
		return q.doMkdir(in, out)
	case OpUnlink, OpRmdir:
		return q.doUnlink(in)
	case OpRename, OpRename2:
		return q.doRename(in)
	case OpLink:
		return q.doLink(in, out)
	case OpOpen, OpOpendir:
		return q.doOpen(in, out)
	case OpCreate, OpTmpfile:
		return q.doCreate(in, out)
	case OpFlush:
		return q.doFlush(in)
	case OpRelease, OpReleasedir:
		return q.doRelease(in)
	case OpFsync, OpFsyncdir:
		return q.doFsync(in)
	case OpReaddir, OpReaddirplus:
		return q.doReaddir(in, out)
	case OpStatfs:
		return q.doStatfs(out)
	case OpAccess:
		return q.doAccess(in)
	case OpSetxattr:
		return q.doSetxattr(in, sess)
	case OpGetxattr, OpListxattr:
		return q.doGetxattr(in, out)
	case OpRemovexattr:
		return q.doRemovexattr(in)
	case OpFallocate:
		return q.doFallocate(in)
	case OpLseek:
		return q.doLseek(in, out)
	case OpCopyFileRange:
		return q.doCopyFileRange(in, out)
	case OpSyncfs:
		return q.doSyncfs(in)
	case OpStatx:
		return q.doStatx(in, out)
	case OpGetlk:
		return q.doGetlk(in, out)
	case OpSetlk, OpSetlkw:
		return q.doSetlk(in)
	case OpDestroy:
		return q.doDestroy()
	case OpInterrupt, OpNotifyReply:
		// The guest never waits for an INTERRUPT answer and we send
		// no notifications to be replied to.
		return 0, noReply
	}
	// IOCTL, BMAP, POLL, SETUPMAPPING, REMOVEMAPPING and unknown
	// opcodes.
	return 0, syscall.ENOSYS
}

// heavyBytes is the size from which a READ or WRITE is worth a second
// core: below it the syscall costs about as much as waking another server,
// and serving it on the current one keeps small I/O on one core.
const heavyBytes = 32 << 10

// Classify tells the ring's servers how to schedule the request in (not yet
// consumed): heavy for a large READ or WRITE, and for a large WRITE the node
// it writes, so writes to one file are not served side by side only to
// contend for its lock; slow for a request whose cost is the host's storage
// whatever its size (FSYNC, FSYNCDIR, FLUSH, FALLOCATE, COPY_FILE_RANGE,
// SYNCFS), so replies already pushed are not held back behind it. It only
// peeks: the cursor is left at the start, and Serve validates everything
// again.
func (q *Queue) Classify(in *bufvec.Vec) (heavy bool, writeNode uint64, slow bool) {
	var b [InHeaderSize + 24]byte // fuse_in_header, then fh, offset, size
	defer in.Rewind()
	if in.Pos() != 0 || in.ReadFull(b[:InHeaderSize]) != nil {
		return false, 0, false
	}
	switch binary.LittleEndian.Uint32(b[4:]) {
	case OpWrite:
		if binary.LittleEndian.Uint32(b[0:]) >= heavyBytes {
			return true, binary.LittleEndian.Uint64(b[16:]), false // nodeid
		}
	case OpRead:
		if in.ReadFull(b[InHeaderSize:]) != nil {
			return false, 0, false
		}
		return binary.LittleEndian.Uint32(b[InHeaderSize+16:]) >= heavyBytes, 0, false
	case OpFsync, OpFsyncdir, OpFlush, OpFallocate, OpCopyFileRange, OpSyncfs:
		return false, 0, true
	}
	return false, 0, false
}
