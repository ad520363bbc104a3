package vhostuser

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"runtime/debug"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
	"github.com/govirtiofsd/govirtiofsd/internal/virtqueue"
)

const (
	// MaxRings is the number of rings the back end serves: KICK and CALL
	// messages carry the ring index in 8 bits.
	MaxRings = 256
	// maxWorkers bounds Config.Workers.
	maxWorkers = 1024
	// maxMemSlots is what GET_MAX_MEM_SLOTS answers (libvhost-user's value).
	maxMemSlots = 509
	// configSize is the size of struct virtio_fs_config: tag[36] and
	// num_request_queues.
	configSize    = 40
	maxConfigSize = 256
	vringNoFD     = 1 << 8
	vringIdxMask  = 0xff
)

// RequestHandler serves the requests one server of a ring pops, one at a
// time: it reads the request from in, writes the reply into out and
// returns the number of bytes written, which becomes the used length.
type RequestHandler interface {
	Serve(in, out *bufvec.Vec) uint32
}

// Classifier is implemented by request handlers that can tell, from a popped
// request, how it should be scheduled.
type Classifier interface {
	// Classify peeks at request in without consuming it. heavy marks a
	// request whose service dwarfs the cost of waking another server (a
	// large READ or WRITE); slow marks one that may take long whatever its
	// size (an fsync): the replies pushed before it are signalled first.
	// writeNode is the node a heavy WRITE writes, 0 for any other request.
	Classify(in *bufvec.Vec) (heavy bool, writeNode uint64, slow bool)
}

// Handler hands out RequestHandlers: one for each server of ring index (0
// is hiprio), made the first time that server runs and kept while the
// ring's size holds (vring.go, slot). A ring has up to 1+Workers servers,
// which serve side by side.
type Handler interface {
	QueueHandler(index int) RequestHandler
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(index int) RequestHandler

// QueueHandler calls f.
func (f HandlerFunc) QueueHandler(index int) RequestHandler { return f(index) }

// Config configures a Backend.
type Config struct {
	// RequestQueues is the number of request queues advertised by
	// GET_QUEUE_NUM (plus one for hiprio) and in the device config.
	RequestQueues int
	// Tag is the file system tag for GET_CONFIG. When empty the CONFIG
	// protocol feature is not offered (QEMU 7.2 warns about it).
	Tag     string
	Handler Handler
	Logger  *slog.Logger
	// Workers caps the extra server goroutines awake at once across all
	// rings, beyond the one each ring always has (--thread-pool-size); 0
	// serves every request on its ring's single server. A ring wakes an
	// extra server only when its handler classifies a request as heavy
	// (doc.go).
	Workers int
	// Metrics keeps per-ring counters for WriteMetrics.
	Metrics bool
	// State is the device state that migrates with the VM; nil: the
	// DEVICE_STATE protocol feature is not offered, and QEMU cannot
	// migrate the VM.
	State DeviceState
	// RingsWatched, if set, is told on the message loop, when a ring
	// starts, that rings 0 to n-1 may each have a server asleep in
	// ppoll(2) on its kick fd, holding its thread's P (kick.go): once for
	// each n larger than any before, never when a ring stops. The daemon
	// gives the process a P for each (cmd/govirtiofsd); nil leaves
	// GOMAXPROCS alone.
	RingsWatched func(n int)
	// CacheSize is the size in bytes of the DAX window (shared-memory
	// region 0) offered to the front end, 0 for none; else
	// CheckCacheSize's rules hold. With a window the SHMEM protocol
	// feature is offered and DEVICE_STATE is not (Window, window.go).
	CacheSize uint64
}

// Backend serves one vhost-user connection.
type Backend struct {
	cfg Config
	log *slog.Logger
	c   *conn

	offered      uint64
	protoOffered uint64
	acked        uint64
	proto        uint64
	owned        bool
	status       uint8

	memory  virtqueue.MemoryMap
	regions []virtqueue.Region // current regions; mappings held by the current table

	rings    [MaxRings]*vring
	dirty    virtqueue.DirtyLog // the migration's dirty-page log, shared by the rings
	transfer *transfer          // the state transfer in progress (SET_DEVICE_STATE_FD)
	// transferStall is how long a state transfer may make no progress
	// (the constant of that name; tests shorten it).
	transferStall time.Duration
	channel       BackendChannel // for back-end-initiated requests (FS_IO)
	busyWorkers   atomic.Int32
	watched       int                  // the most rings told to Config.RingsWatched
	stats         *[MaxRings]ringStats // nil with Config.Metrics off
	window        Window               // the DAX window; size 0 without one
	// callRings is one more than the highest ring index SET_VRING_CALL
	// named on this connection: the rings the front end set up
	// (getConfig).
	callRings int
	capLogged bool // requestQueues said once that it capped the answer
}

// NewBackend returns a back end for cfg.
func NewBackend(cfg Config) (*Backend, error) {
	if cfg.Handler == nil {
		return nil, errors.New("vhostuser: no handler")
	}
	if cfg.RequestQueues < 1 || cfg.RequestQueues > MaxRings-1 {
		return nil, fmt.Errorf("vhostuser: %d request queues, want 1..%d", cfg.RequestQueues, MaxRings-1)
	}
	if cfg.Workers < 0 || cfg.Workers > maxWorkers {
		return nil, fmt.Errorf("vhostuser: %d workers, want 0..%d", cfg.Workers, maxWorkers)
	}
	if len(cfg.Tag) > 36 {
		return nil, fmt.Errorf("vhostuser: tag %q longer than 36 bytes", cfg.Tag)
	}
	if cfg.CacheSize != 0 {
		if err := CheckCacheSize(cfg.CacheSize); err != nil {
			return nil, fmt.Errorf("vhostuser: %w", err)
		}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	b := &Backend{cfg: cfg, log: cfg.Logger, transferStall: transferStall}
	b.window.init(b, cfg.CacheSize)
	if cfg.Metrics {
		b.stats = new([MaxRings]ringStats)
	}
	b.offer()
	return b, nil
}

// Channel returns the channel for back-end-initiated requests.
func (b *Backend) Channel() *BackendChannel { return &b.channel }

// ServeFirst accepts one front end on ln, stops listening (one front end per
// daemon, as with the C and Rust daemons) and serves it with Serve.
func (b *Backend) ServeFirst(ln *net.UnixListener) error {
	c, err := ln.AcceptUnix()
	if err != nil {
		return fmt.Errorf("accept: %w", err)
	}
	ln.Close()
	b.log.Info("front end connected")
	defer c.Close()
	return b.Serve(c)
}

// Serve runs the message loop on c until the front end disconnects. It
// returns nil on a clean disconnect and an error when the stream broke; in
// both cases every ring is stopped and all memory released.
func (b *Backend) Serve(uc *net.UnixConn) error {
	b.c = newConn(uc)
	b.callRings, b.capLogged = 0, false
	// Guest memory the message loop reads (a ring's indices) may fault:
	// a guest can put its rings in a DAX window page and truncate the
	// file behind it. That fails the message (faultSafe), not the daemon.
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer b.shutdown()
	for {
		m, err := b.c.readMessage()
		if err != nil {
			if isDisconnect(err) {
				b.log.Info("front end disconnected", "how", err.Error())
				return nil
			}
			if m != nil {
				// Skipped an oversized payload: refuse it, stay connected.
				b.refuse(m, err)
				continue
			}
			return fmt.Errorf("read message: %w", err)
		}
		var derr error
		if ferr := faultSafe(func() error { derr = b.dispatch(m); return nil }); ferr != nil {
			m.closeFDs()
			b.refuse(m, ferr) // logged; answered if the front end waits for an ack
		}
		if derr != nil {
			if isDisconnect(derr) {
				b.log.Info("front end disconnected before our reply", "how", derr.Error())
				return nil
			}
			return derr
		}
	}
}

// shutdown stops every ring and releases memory and fds.
func (b *Backend) shutdown() {
	b.abortTransfer()
	for _, r := range b.rings {
		if r != nil {
			r.reset()
		}
	}
	b.dirty.SetActive(false)
	b.dirty.Replace(nil, nil)
	b.memory.Replace(nil)
	b.regions = nil
	b.window.forget("front end gone")
	b.channel.close()
}

func (b *Backend) ring(index uint32) (*vring, error) {
	if index >= MaxRings {
		return nil, fmt.Errorf("ring index %d beyond %d", index, MaxRings-1)
	}
	if b.rings[index] == nil {
		b.rings[index] = newVring(b, int(index))
	}
	return b.rings[index], nil
}

// refuse logs a message that could not be honoured and, when the front end
// waits for an answer, reports the failure.
func (b *Backend) refuse(m *Message, err error) {
	b.log.Warn("vhost-user message refused", "request", requestName(m.Request), "err", err)
	if b.alwaysReplied(m.Request) {
		if err := b.c.replyU64(m.Request, stateReplyError|stateReplyNoFD); err != nil {
			b.log.Warn("reply", "err", err)
		}
		return
	}
	if m.needReply() && b.proto&protoReplyAck != 0 {
		if err := b.c.replyU64(m.Request, 1); err != nil {
			b.log.Warn("reply", "err", err)
		}
	}
}

// dispatch handles one message. Only a failure to write a reply (the
// connection is gone) is returned.
func (b *Backend) dispatch(m *Message) error {
	b.log.Debug("vhost-user message", "request", requestName(m.Request), "size", len(m.Payload), "fds", len(m.FDs))
	defer m.closeFDs()
	if m.fdsLost && takesFDs(m.Request) {
		b.refuse(m, fmt.Errorf("more than %d fds attached: the kernel dropped the rest", maxFDs))
		return nil
	}
	var (
		reply   []byte // the request's own reply, if it has one
		replied = true
		err     error
	)
	switch m.Request {
	case reqGetFeatures:
		reply = u64(b.offered)
	case reqGetProtocolFeatures:
		reply = u64(b.protoOffered)
	case reqGetQueueNum:
		reply = u64(uint64(1 + b.cfg.RequestQueues))
	case reqGetMaxMemSlots:
		reply = u64(maxMemSlots)
	case reqGetStatus:
		reply = u64(uint64(b.status))
	case reqGetVringBase:
		reply, err = b.getVringBase(m)
	case reqGetConfig:
		reply, err = b.getConfig(m)
	case reqGetShmemConfig:
		if b.proto&protoShmem == 0 {
			replied = false
			err = errors.New("SHMEM not negotiated")
			break
		}
		reply = b.shmemConfig()
	case reqGetInflightFD:
		// Not offered; answer an empty area so a confused front end
		// does not wait forever.
		reply = make([]byte, 8+8+2+2)
	case reqSetDeviceStateFD, reqCheckDeviceState, reqSetLogBase:
		if m.Request == reqSetDeviceStateFD && b.cfg.CacheSize > 0 {
			replied = false
			err = errors.New("no migration while a DAX window is offered (--cache-size): QEMU blocks it, and the guest's mappings could not follow")
			break
		}
		if !b.alwaysReplied(m.Request) {
			// Not negotiated: refused as an unknown request is.
			replied = false
			err = fmt.Errorf("%s: not negotiated", requestName(m.Request))
			break
		}
		reply, err = b.migrationMessage(m)
	default:
		replied = false
		err = b.handleSet(m)
	}
	if replied {
		if err != nil {
			b.log.Warn("vhost-user message refused", "request", requestName(m.Request), "err", err)
		}
		return b.c.reply(m.Request, reply)
	}
	if err != nil {
		b.refuse(m, err)
		return nil
	}
	if m.needReply() && b.proto&protoReplyAck != 0 {
		return b.c.replyU64(m.Request, 0)
	}
	return nil
}

// alwaysReplied reports whether request req has a reply of its own, which
// a refusal must still send: the front end waits for it.
func (b *Backend) alwaysReplied(req uint32) bool {
	switch req {
	case reqSetLogBase:
		return b.proto&protoLogShmFD != 0
	case reqSetDeviceStateFD, reqCheckDeviceState:
		return b.proto&protoDeviceState != 0
	}
	return false
}

func u64(v uint64) []byte {
	b := make([]byte, 8)
	binary.LittleEndian.PutUint64(b, v)
	return b
}

// setters handle the messages that have no reply of their own.
var setters = map[uint32]func(*Backend, *Message) error{
	reqSetOwner:            (*Backend).setOwner,
	reqResetOwner:          (*Backend).resetDevice,
	reqResetDevice:         (*Backend).resetDevice,
	reqSetFeatures:         (*Backend).setFeatures,
	reqSetProtocolFeatures: (*Backend).setProtocolFeatures,
	reqSetMemTable:         (*Backend).setMemTable,
	reqAddMemReg:           (*Backend).addMemReg,
	reqRemMemReg:           (*Backend).remMemReg,
	reqSetVringNum:         (*Backend).setVringNum,
	reqSetVringAddr:        (*Backend).setVringAddr,
	reqSetVringBase:        (*Backend).setVringBase,
	reqSetVringKick:        (*Backend).setVringKick,
	reqSetVringCall:        (*Backend).setVringCall,
	reqSetVringErr:         (*Backend).setVringErr,
	reqSetVringEnable:      (*Backend).setVringEnable,
	reqSetBackendReqFD:     (*Backend).setBackendReqFD,
	reqSetStatus:           (*Backend).setStatus,
}

// handleSet handles the messages that have no reply of their own.
func (b *Backend) handleSet(m *Message) error {
	if set := setters[m.Request]; set != nil {
		return set(b, m)
	}
	switch m.Request {
	case reqSetConfig:
		return errors.New("the virtio-fs config space is read-only")
	case reqSetLogFD, reqSetInflightFD:
		return errors.New("not supported (the log comes with SET_LOG_BASE; no inflight tracking)")
	}
	return errors.New("unknown or unsupported request")
}

func (b *Backend) setOwner(*Message) error {
	b.owned = true
	return nil
}

func (b *Backend) setBackendReqFD(m *Message) error {
	fd := m.takeFD()
	if fd < 0 {
		return errors.New("no fd attached")
	}
	b.window.forget("new back-end channel")
	b.channel.set(fd)
	return nil
}

func (b *Backend) setStatus(m *Message) error {
	v, err := payloadU64(m)
	if err != nil {
		return err
	}
	// Recorded for GET_STATUS only: QEMU 7.2 never sends DRIVER_OK
	// for fs, so status must not drive the ring lifecycle.
	b.status = uint8(v)
	return nil
}

// resetDevice handles RESET_OWNER and RESET_DEVICE: every ring stops and
// forgets its configuration, and the acknowledged features and the status
// are forgotten.
func (b *Backend) resetDevice(*Message) error {
	b.abortTransfer()
	b.window.forget("device reset")
	for _, r := range b.rings {
		if r != nil {
			r.reset()
		}
	}
	b.setLogging(false, b.acked&featLogAll != 0)
	b.dirty.Replace(nil, nil) // a device started again gets a new log
	b.acked = 0
	b.status = 0
	return nil
}

// ringState decodes a ring state payload (SET_VRING_NUM, SET_VRING_BASE,
// SET_VRING_ENABLE, GET_VRING_BASE): the ring it names and its value.
func (b *Backend) ringState(m *Message) (*vring, vringState, error) {
	s, err := payloadVringState(m)
	if err != nil {
		return nil, s, err
	}
	r, err := b.ring(s.index)
	return r, s, err
}

// stoppedRing is ringState for a message that configures a ring that must
// not be running.
func (b *Backend) stoppedRing(m *Message) (*vring, vringState, error) {
	r, s, err := b.ringState(m)
	if err == nil && r.started() {
		err = fmt.Errorf("ring %d is running", s.index)
	}
	return r, s, err
}

// ringFile decodes a ring file payload (SET_VRING_KICK, SET_VRING_CALL,
// SET_VRING_ERR): the ring it names and the fd attached, which is -1 when
// the front end sends none (NOFD). what names the fd in an error.
func (b *Backend) ringFile(m *Message, what string) (*vring, int, error) {
	v, err := payloadU64(m)
	if err != nil {
		return nil, -1, err
	}
	r, err := b.ring(uint32(v & vringIdxMask))
	if err != nil {
		return nil, -1, err
	}
	fd := -1
	if v&vringNoFD == 0 {
		if fd = m.takeFD(); fd < 0 {
			return nil, -1, fmt.Errorf("ring %d: no %s attached", r.index, what)
		}
	}
	return r, fd, nil
}

func (b *Backend) setVringNum(m *Message) error {
	r, s, err := b.stoppedRing(m)
	if err != nil {
		return err
	}
	if s.num == 0 || s.num > virtqueue.MaxSize {
		return fmt.Errorf("ring %d size %d not in 1..%d", s.index, s.num, virtqueue.MaxSize)
	}
	if s.num&(s.num-1) != 0 && b.acked&featRingPacked == 0 {
		return fmt.Errorf("ring %d size %d is not a power of two (split ring)", s.index, s.num)
	}
	r.num = uint16(s.num)
	return nil
}

func (b *Backend) setVringBase(m *Message) error {
	r, s, err := b.stoppedRing(m)
	if err != nil {
		return err
	}
	// A packed ring's base is 32 bits (both indices and wrap counters),
	// checked against the ring's size when it starts.
	if s.num > 0xffff && b.acked&featRingPacked == 0 {
		return fmt.Errorf("ring %d base %d beyond 16 bits (split ring)", s.index, s.num)
	}
	r.base, r.baseSet = s.num, true
	return nil
}

func (b *Backend) setVringAddr(m *Message) error {
	a, err := payloadVringAddr(m)
	if err != nil {
		return err
	}
	r, err := b.ring(a.index)
	if err != nil {
		return err
	}
	if a.flags&^vringFlagLog != 0 {
		return fmt.Errorf("ring %d: unknown address flags %#x", a.index, a.flags)
	}
	logUsed := a.flags&vringFlagLog != 0
	if r.started() {
		// Logging starts and stops on running rings: QEMU resends the
		// same addresses with VHOST_VRING_F_LOG set or cleared.
		if a.desc != r.addr.desc || a.avail != r.addr.avail || a.used != r.addr.used {
			return fmt.Errorf("ring %d is running: only its log flag and log address may change", a.index)
		}
		r.queue.SetUsedLog(logUsed, a.logGPA)
		b.log.Debug("ring used-ring logging", "queue", r.index, "on", logUsed, "log_addr", fmt.Sprintf("%#x", a.logGPA))
	}
	r.addr, r.hasAddr = a, true
	return nil
}

// setVringKick starts the ring (or swaps its kick fd if it runs).
func (b *Backend) setVringKick(m *Message) error {
	r, fd, err := b.ringFile(m, "kick fd")
	if err != nil {
		return err
	}
	if r.started() {
		r.pause()
		if r.kickFD >= 0 {
			unix.Close(r.kickFD)
		}
		r.kickFD = fd
		r.resume()
		return nil
	}
	if r.kickFD >= 0 {
		unix.Close(r.kickFD)
	}
	r.kickFD = fd
	b.finishTransfer() // a loading state is installed before anything is served
	if b.acked&featProtocolFeatures == 0 {
		// Without PROTOCOL_FEATURES a ring is enabled when it starts.
		r.enabled = true
	}
	if err := r.start(); err != nil {
		return fmt.Errorf("start ring %d: %w", r.index, err)
	}
	r.resume()
	return nil
}

func (b *Backend) setVringCall(m *Message) error {
	if err := b.setVringFile(m, (*vring).setCall); err != nil {
		return err
	}
	if v, _ := payloadU64(m); int(v&vringIdxMask) >= b.callRings {
		b.callRings = int(v&vringIdxMask) + 1
	}
	return nil
}
func (b *Backend) setVringErr(m *Message) error { return b.setVringFile(m, (*vring).setErr) }

func (b *Backend) setVringFile(m *Message, set func(*vring, int)) error {
	r, fd, err := b.ringFile(m, "fd")
	if err != nil {
		return err
	}
	set(r, fd)
	return nil
}

func (b *Backend) setVringEnable(m *Message) error {
	r, s, err := b.ringState(m)
	if err != nil {
		return err
	}
	switch s.num {
	case 0:
		r.enabled = false
		r.pause()
	case 1:
		r.enabled = true
		r.resume()
	default:
		return fmt.Errorf("ring %d enable value %d", s.index, s.num)
	}
	return nil
}

// getVringBase stops the ring and reports the next avail index to process.
// It returns only once every chain the ring popped has been completed and
// pushed, so a restart at that index neither repeats nor loses a request.
func (b *Backend) getVringBase(m *Message) ([]byte, error) {
	reply := make([]byte, 8)
	r, s, err := b.ringState(m)
	binary.LittleEndian.PutUint32(reply, s.index) // 0 when the payload is short
	if err != nil {
		return reply, err
	}
	base := r.stop()
	binary.LittleEndian.PutUint32(reply[4:], base)
	b.log.Debug("ring stopped", "queue", r.index, "base", base)
	return reply, nil
}

// getConfig answers from struct virtio_fs_config.
func (b *Backend) getConfig(m *Message) ([]byte, error) {
	p := m.Payload
	if len(p) < 12 {
		return make([]byte, 12), fmt.Errorf("payload of %d bytes, want at least 12", len(p))
	}
	off := binary.LittleEndian.Uint32(p[0:])
	size := binary.LittleEndian.Uint32(p[4:])
	reply := make([]byte, 12)
	copy(reply, p[:12])
	if size > maxConfigSize || len(p) != 12+int(size) {
		binary.LittleEndian.PutUint32(reply[4:], 0)
		return reply, fmt.Errorf("config size %d with payload %d", size, len(p))
	}
	var cfg [configSize]byte
	copy(cfg[:36], b.cfg.Tag)
	binary.LittleEndian.PutUint32(cfg[36:], uint32(b.requestQueues()))
	data := make([]byte, size)
	if uint64(off) < configSize {
		copy(data, cfg[off:])
	}
	return append(reply, data...), nil
}

// requestQueues is the num_request_queues of the device config. A front
// end that passes our config through to the guest (QEMU's
// vhost-user-test-device-pci, which gives the guest num_vqs rings whatever
// we say) sets up each of its rings with SET_VRING_CALL at realize, before
// the guest reads the config: a guest told of more request queues than
// that asks for rings the device lacks and its probe fails (-22). So the
// answer is capped at the rings set up, less hiprio, once that is known.
// vhost-user-fs-pci writes its own config and never asks.
func (b *Backend) requestQueues() int {
	n := b.cfg.RequestQueues
	if b.callRings >= 2 && b.callRings-1 < n {
		n = b.callRings - 1
		if !b.capLogged {
			b.capLogged = true
			b.log.Info("device config: num_request_queues follows the rings the front end set up",
				"num_request_queues", n, "rings", b.callRings, "queues", b.cfg.RequestQueues)
		}
	}
	return n
}

// shmemConfig is GET_SHMEM_CONFIG's answer: u32 nregions, u32 padding,
// u64 sizes[256] indexed by shmid. Region 0 (Linux's
// VIRTIO_FS_SHMCAP_ID_CACHE) is the window.
func (b *Backend) shmemConfig() []byte {
	reply := make([]byte, shmemConfigSize)
	binary.LittleEndian.PutUint32(reply[0:], 1)
	binary.LittleEndian.PutUint64(reply[8:], b.cfg.CacheSize)
	return reply
}
