package vmm

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// DefaultFeatures are the virtio features Linux's virtio_fs driver accepts
// (plus VHOST_USER_F_PROTOCOL_FEATURES, which QEMU adds for the back end).
const DefaultFeatures = 1<<FVersion1 | 1<<FIndirectDesc | 1<<FEventIdx | 1<<FProtocolFeatures

// QEMUProtocolFeatures is what QEMU 7.2 acknowledges for vhost-user-fs:
// every bit it knows (0-16) except CONFIG, which it clears for devices
// without config space handling.
const QEMUProtocolFeatures = (1<<17 - 1) &^ (1 << PConfig)

// Options configure a Device. Zero values of Features, ProtocolFeatures,
// Queues, QueueSize, Layout and Timeout select defaults; start from
// DefaultOptions to get the default buffer placement too.
//
// Packed rings: a test that adds Bit(FRingPacked) to Features gets packed
// rings if the back end offers them and split rings otherwise, as QEMU's
// packed=on does; one that puts it in RequireFeatures gets packed rings or
// an ErrNotOffered from Init (so from Start).
type Options struct {
	Features         uint64        // virtio features the guest accepts (intersected with the offer)
	RequireFeatures  uint64        // virtio features Init fails without (ErrNotOffered); implied in Features
	ProtocolFeatures uint64        // protocol features the front end knows (intersected with the offer)
	Queues           int           // rings including hiprio (QEMU: num-request-queues + 1); default 2
	QueueSize        uint16        // descriptors per ring; default 128 (QEMU's default queue-size); any size up to 32768 on packed rings
	Layout           []RegionSpec  // guest RAM; default SplitLayout(64 MiB, 64 MiB)
	Hotplug          []int         // layout regions not announced at start (see AddRegion)
	RingRegion       int           // region holding the rings
	BufRegion        int           // region holding request buffers and indirect tables (-1: any)
	Indirect         IndirectMode  // chain shape for Do
	Kick             KickMode      // kick policy
	Notify           NotifyMode    // completion notice policy
	Ack              AckPolicy     // NEED_REPLY policy once REPLY_ACK is negotiated
	QuietKick        bool          // kick eventfds start at 0 instead of QEMU's 1
	Timeout          time.Duration // for replies and completions; default 5 s
	// Shmem acknowledges the SHMEM protocol feature when offered and sets
	// up the back end's window at Init (shmem.go); WindowBase is its
	// guest-physical address (0: DefaultWindowBase).
	Shmem      bool
	WindowBase uint64
}

// DefaultOptions returns the defaults, with the rings in the low region and
// request buffers in the high one, so that both translations are used.
func DefaultOptions() Options {
	return Options{
		Features:         DefaultFeatures,
		ProtocolFeatures: QEMUProtocolFeatures,
		Queues:           2,
		QueueSize:        128,
		Layout:           SplitLayout(64*MiB, 64*MiB),
		BufRegion:        1,
		Timeout:          5 * time.Second,
	}
}

func (o *Options) fill() {
	d := DefaultOptions()
	if o.Features == 0 {
		o.Features = d.Features
	}
	o.Features |= o.RequireFeatures
	if o.ProtocolFeatures == 0 {
		o.ProtocolFeatures = d.ProtocolFeatures
	}
	if o.Queues == 0 {
		o.Queues = d.Queues
	}
	if o.QueueSize == 0 {
		o.QueueSize = d.QueueSize
	}
	if o.Layout == nil {
		o.Layout = d.Layout
	}
	if o.Timeout == 0 {
		o.Timeout = d.Timeout
	}
}

// Device is one vhost-user-fs device as QEMU drives it, with the guest
// driver's rings.
type Device struct {
	Conn    *Conn   // the vhost-user connection
	Mem     *Memory // guest RAM
	Queues  []*Queue
	Backend *Conn // our end of the backend-request channel, if negotiated

	Offered          uint64  // GET_FEATURES answer
	Features         uint64  // what SET_FEATURES sent
	OfferedProtocol  uint64  // GET_PROTOCOL_FEATURES answer
	ProtocolFeatures uint64  // what SET_PROTOCOL_FEATURES sent
	QueueNum         uint64  // GET_QUEUE_NUM answer (0 if not asked)
	MaxMemSlots      uint64  // GET_MAX_MEM_SLOTS answer (0 if not asked)
	ShmemRegions     uint32  // GET_SHMEM_CONFIG's nregions (Options.Shmem)
	Window           *Window // shared-memory region 0, if the back end has one (Options.Shmem)

	opts      Options
	announced []bool   // per region: the back end knows it
	bases     []uint32 // per queue: SET_VRING_BASE for the next start (split: next avail index; packed: PackedBase)
	started   bool     // StartRings has run: features are negotiated and bases in their ring's encoding
	running   bool
	logging   bool      // between StartLogging and StopLogging
	log       *DirtyLog // the log while logging
	closeOnce sync.Once

	windowMu   sync.Mutex
	windowErrs []string // why ServeWindow refused requests
}

// New prepares guest memory and rings for a device on conn; it sends
// nothing.
func New(conn *Conn, opts Options) (*Device, error) {
	opts.fill()
	conn.Timeout, conn.Ack = opts.Timeout, opts.Ack
	mem, err := NewMemory(opts.Layout)
	if err != nil {
		return nil, err
	}
	d := &Device{Conn: conn, Mem: mem, opts: opts, announced: make([]bool, len(opts.Layout)),
		bases: make([]uint32, opts.Queues)}
	for i := range opts.Queues {
		q, err := NewQueue(mem, i, d.queueConfig())
		if err != nil {
			d.Close()
			return nil, err
		}
		d.Queues = append(d.Queues, q)
	}
	return d, nil
}

// queueConfig lays rings out as packed if the options ask for packed
// rings; StartRings switches a ring to the other layout if negotiation
// disagrees.
func (d *Device) queueConfig() QueueConfig {
	return QueueConfig{
		Packed:     d.opts.Features&Bit(FRingPacked) != 0,
		Size:       d.opts.QueueSize,
		Kick:       d.opts.Kick,
		Notify:     d.opts.Notify,
		RingRegion: d.opts.RingRegion,
		BufRegion:  d.opts.BufRegion,
		QuietKick:  d.opts.QuietKick,
	}
}

// Connect dials the back end's socket and prepares a Device (nothing sent).
func Connect(path string, opts Options) (*Device, error) {
	opts.fill()
	c, err := Dial(path, opts.Timeout)
	if err != nil {
		return nil, err
	}
	d, err := New(c, opts)
	if err != nil {
		c.Close()
		return nil, err
	}
	return d, nil
}

// Start connects and brings the device up exactly as QEMU 7.2 does for
// vhost-user-fs-pci: Init at realize, StartRings at the guest's DRIVER_OK.
func Start(path string, opts Options) (*Device, error) {
	d, err := Connect(path, opts)
	if err != nil {
		return nil, err
	}
	if err := d.Init(); err != nil {
		d.Close()
		return nil, err
	}
	if err := d.StartRings(); err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

// Options returns the (filled-in) options.
func (d *Device) Options() Options { return d.opts }

// Negotiated reports whether virtio feature bit was sent in SET_FEATURES.
func (d *Device) Negotiated(bit uint) bool { return d.Features&Bit(bit) != 0 }

// Packed reports whether the rings are packed (VIRTIO_F_RING_PACKED was
// sent in SET_FEATURES).
func (d *Device) Packed() bool { return d.Negotiated(FRingPacked) }

// resetBase is the SET_VRING_BASE value of a ring the driver has just set
// up: 0, or PackedResetBase (both wrap counters 1) on a packed ring.
func (d *Device) resetBase() uint32 {
	if d.Packed() {
		return PackedResetBase
	}
	return 0
}

// ErrNotOffered is Init's error when the back end does not offer a feature
// in Options.RequireFeatures.
var ErrNotOffered = errors.New("vmm: the back end does not offer a required feature")

// HasProtocol reports whether protocol feature bit was acknowledged.
func (d *Device) HasProtocol(bit uint) bool { return d.ProtocolFeatures&Bit(bit) != 0 }

func (d *Device) hotplugged(i int) bool { return slices.Contains(d.opts.Hotplug, i) }

// Init is QEMU's vhost_user_backend_init + vhost_dev_init:
//
//	GET_FEATURES
//	GET_PROTOCOL_FEATURES, SET_PROTOCOL_FEATURES  (if PROTOCOL_FEATURES offered)
//	GET_QUEUE_NUM                                 (if MQ)
//	GET_MAX_MEM_SLOTS                             (if CONFIGURE_MEM_SLOTS)
//	SET_BACKEND_REQ_FD, NEED_REPLY with REPLY_ACK (if BACKEND_REQ)
//	SET_OWNER
//	GET_FEATURES
//	GET_SHMEM_CONFIG                              (if SHMEM, Options.Shmem)
//	per ring: SET_VRING_CALL (QEMU's masked notifier), SET_VRING_ERR
func (d *Device) Init() error {
	c := d.Conn
	var err error
	if d.Offered, err = c.GetFeatures(); err != nil {
		return err
	}
	if missing := d.opts.RequireFeatures &^ d.Offered; missing != 0 {
		return fmt.Errorf("%w: %#x (offered %#x)", ErrNotOffered, missing, d.Offered)
	}
	if d.Offered&Bit(FProtocolFeatures) != 0 {
		if d.OfferedProtocol, err = c.GetProtocolFeatures(); err != nil {
			return err
		}
		known := d.opts.ProtocolFeatures
		if d.opts.Shmem {
			known |= Bit(PShmem)
		}
		d.ProtocolFeatures = d.OfferedProtocol & known
		if err := c.SetProtocolFeatures(d.ProtocolFeatures); err != nil {
			return err
		}
	}
	if d.HasProtocol(PMQ) {
		if d.QueueNum, err = c.GetQueueNum(); err != nil {
			return err
		}
	}
	if d.HasProtocol(PConfigureMemSlots) {
		if d.MaxMemSlots, err = c.GetMaxMemSlots(); err != nil {
			return err
		}
	}
	if d.HasProtocol(PBackendReq) {
		ours, theirs, err := SocketPair()
		if err != nil {
			return err
		}
		err = c.SetBackendReqFd(int(theirs.Fd()))
		theirs.Close()
		if err != nil {
			ours.Close()
			return err
		}
		ours.Timeout = d.opts.Timeout
		d.Backend = ours
	}
	if err := c.SetOwner(); err != nil {
		return err
	}
	if _, err := c.GetFeatures(); err != nil {
		return err
	}
	if d.HasProtocol(PShmem) && d.Window == nil {
		// QEMU 11.1's vhost-user-base realize asks once.
		if err := d.getShmemConfig(); err != nil {
			return err
		}
	}
	for i, q := range d.Queues {
		if err := c.SetVringCall(uint32(i), q.CallFd()); err != nil {
			return err
		}
		if err := c.SetVringErr(uint32(i), q.ErrFd()); err != nil {
			return err
		}
	}
	return nil
}

// StartRings is QEMU's vhost_dev_start at the guest's DRIVER_OK:
//
//	SET_FEATURES (+ GET_STATUS, SET_STATUS(FEATURES_OK) with STATUS)
//	ADD_MEM_REG per new region (CONFIGURE_MEM_SLOTS), else SET_MEM_TABLE
//	per ring: SET_VRING_NUM, SET_VRING_BASE, SET_VRING_ADDR, SET_VRING_KICK
//	per ring: SET_VRING_ENABLE 1 (with PROTOCOL_FEATURES)
//	per ring: SET_VRING_CALL (the guest unmasks its vector: a new call fd)
//
// Rings start at the bases saved by Stop (initially 0, or PackedResetBase
// on packed rings).
func (d *Device) StartRings() error {
	c := d.Conn
	d.Features = d.Offered & d.opts.Features
	for _, q := range d.Queues {
		q.SetNegotiated(d.Negotiated(FEventIdx), d.Negotiated(FIndirectDesc))
		if err := q.setPacked(d.Packed()); err != nil {
			return err
		}
	}
	if !d.started {
		// Features are known only now, and with them what a fresh
		// ring's base is.
		for i := range d.bases {
			d.bases[i] = d.resetBase()
		}
		d.started = true
	}
	features := d.Features
	if d.logging {
		features |= Bit(FLogAll)
	}
	if err := c.SetFeatures(features); err != nil {
		return err
	}
	if d.HasProtocol(PStatus) {
		s, err := c.GetStatus()
		if err != nil {
			return err
		}
		if s&StatusFeaturesOK == 0 {
			if err := c.SetStatus(s | StatusFeaturesOK); err != nil {
				return err
			}
		}
	}
	if err := d.syncMemory(); err != nil {
		return err
	}
	for i := range d.Queues {
		if err := d.startRing(i, d.bases[i]); err != nil {
			return err
		}
	}
	if d.logging {
		if err := d.SetLogBaseFor(d.log); err != nil {
			return err
		}
	}
	if d.Negotiated(FProtocolFeatures) {
		for i := range d.Queues {
			if err := c.SetVringEnable(uint32(i), true); err != nil {
				return err
			}
		}
	}
	for i := range d.Queues {
		if err := d.unmask(i); err != nil {
			return err
		}
	}
	d.running = true
	return nil
}

// syncMemory announces guest RAM: the regions not yet known with
// ADD_MEM_REG (CONFIGURE_MEM_SLOTS), or the whole table with SET_MEM_TABLE
// (QEMU resends it on every start).
func (d *Device) syncMemory() error {
	if d.HasProtocol(PConfigureMemSlots) {
		for i, r := range d.Mem.Regions() {
			if !d.announced[i] && !d.hotplugged(i) {
				if err := d.Conn.AddMemReg(r.MemRegion(), r.Fd()); err != nil {
					return err
				}
				d.announced[i] = true
			}
		}
		return nil
	}
	for i := range d.announced {
		if !d.hotplugged(i) {
			d.announced[i] = true
		}
	}
	return d.SendMemTable()
}

// SendMemTable sends SET_MEM_TABLE with every announced region.
func (d *Device) SendMemTable() error {
	var regs []MemRegion
	var fds []int
	for i, r := range d.Mem.Regions() {
		if d.announced[i] {
			regs = append(regs, r.MemRegion())
			fds = append(fds, r.Fd())
		}
	}
	return d.Conn.SetMemTable(regs, fds)
}

// AddRegion hot-plugs layout region i: ADD_MEM_REG with CONFIGURE_MEM_SLOTS,
// else a new SET_MEM_TABLE, as QEMU does for memory hotplug.
func (d *Device) AddRegion(i int) error {
	d.announced[i] = true
	if d.HasProtocol(PConfigureMemSlots) {
		r := d.Mem.Regions()[i]
		return d.Conn.AddMemReg(r.MemRegion(), r.Fd())
	}
	return d.SendMemTable()
}

// RemoveRegion unplugs layout region i: REM_MEM_REG (QEMU attaches the fd)
// with CONFIGURE_MEM_SLOTS, else a new SET_MEM_TABLE without it.
func (d *Device) RemoveRegion(i int) error {
	d.announced[i] = false
	if d.HasProtocol(PConfigureMemSlots) {
		r := d.Mem.Regions()[i]
		return d.Conn.RemMemReg(r.MemRegion(), r.Fd())
	}
	return d.SendMemTable()
}

// startRing is QEMU's vhost_virtqueue_start: NUM, BASE, ADDR, KICK.
func (d *Device) startRing(i int, base uint32) error {
	c, q := d.Conn, d.Queues[i]
	if err := c.SetVringNum(uint32(i), uint32(q.Size())); err != nil {
		return err
	}
	if err := c.SetVringBase(uint32(i), base); err != nil {
		return err
	}
	a, err := d.ringAddr(i)
	if err != nil {
		return err
	}
	if err := c.SetVringAddr(a); err != nil {
		return err
	}
	kick, err := q.NewKickFd()
	if err != nil {
		return err
	}
	return c.SetVringKick(uint32(i), kick)
}

// unmask hands the back end a new call fd for ring i.
func (d *Device) unmask(i int) error {
	fd, err := d.Queues[i].NewCallFd()
	if err != nil {
		return err
	}
	return d.Conn.SetVringCall(uint32(i), fd)
}

// Stop is QEMU's vhost_dev_stop (guest reset, pause, quit): SET_VRING_ENABLE
// 0 on every ring, GET_VRING_BASE on every ring, then SET_VRING_CALL with a
// masked notifier. It returns the bases and keeps them for Restart. On a
// packed ring a base holds both of the back end's indices and wrap
// counters (ParsePackedBase); Restart sends all 32 bits back.
func (d *Device) Stop() ([]uint32, error) {
	c := d.Conn
	if d.Negotiated(FProtocolFeatures) {
		for i := range d.Queues {
			if err := c.SetVringEnable(uint32(i), false); err != nil {
				return nil, err
			}
		}
	}
	for i := range d.Queues {
		b, err := c.GetVringBase(uint32(i))
		if err != nil {
			return nil, err
		}
		d.bases[i] = b
	}
	for i := range d.Queues {
		if err := d.unmask(i); err != nil {
			return nil, err
		}
	}
	d.running = false
	return slices.Clone(d.bases), nil
}

// Restart is StartRings after Stop, resuming every ring at its saved base
// (a resumed VM). With newRings, every ring instead restarts from index 0
// in fresh memory (a rebooted guest or a driver reset).
func (d *Device) Restart(newRings bool) error {
	if newRings {
		for i, q := range d.Queues {
			if err := q.Reset(true); err != nil {
				return err
			}
			d.bases[i] = d.resetBase()
		}
	}
	return d.StartRings()
}

// GuestReset is a guest reboot: Stop, then Restart with new rings at base 0.
func (d *Device) GuestReset() error {
	if _, err := d.Stop(); err != nil {
		return err
	}
	return d.Restart(true)
}

// StopQueue stops one ring as Stop does for all: SET_VRING_ENABLE 0,
// GET_VRING_BASE, whose answer (the next avail index the back end would
// process; on a packed ring a PackedBase) it returns, and SET_VRING_CALL
// with a masked notifier.
//
// That last CALL matters: libvhost-user closes its call fd at
// GET_VRING_BASE, and its queue thread, restarted by SET_VRING_KICK (whose
// eventfd QEMU creates signalled), panics writing call fd -1 if it
// completes a request before a new SET_VRING_CALL arrives.
func (d *Device) StopQueue(i int) (uint32, error) {
	if d.Negotiated(FProtocolFeatures) {
		if err := d.Conn.SetVringEnable(uint32(i), false); err != nil {
			return 0, err
		}
	}
	b, err := d.Conn.GetVringBase(uint32(i))
	if err != nil {
		return 0, err
	}
	d.bases[i] = b
	return b, d.unmask(i)
}

// RestartQueue restarts one ring at base: SET_VRING_NUM, BASE, ADDR, KICK,
// ENABLE 1 and a new CALL fd. With newRing the driver state is reset and
// the ring moves to fresh memory first (chains in flight are abandoned);
// pass base 0 then, which on a packed ring stands for PackedResetBase, the
// base of a fresh ring (indices 0 and wrap counters 1), so that the same
// call serves both layouts.
func (d *Device) RestartQueue(i int, base uint32, newRing bool) error {
	if newRing {
		if err := d.Queues[i].Reset(true); err != nil {
			return err
		}
		if base == 0 {
			base = d.resetBase()
		}
	}
	d.bases[i] = base
	if err := d.startRing(i, base); err != nil {
		return err
	}
	if d.Negotiated(FProtocolFeatures) {
		if err := d.Conn.SetVringEnable(uint32(i), true); err != nil {
			return err
		}
	}
	return d.unmask(i)
}

// Close disconnects from the back end and releases everything. Chains in
// flight are abandoned.
func (d *Device) Close() error {
	d.closeOnce.Do(func() {
		d.Conn.Close()
		if d.Backend != nil {
			d.Backend.Close()
		}
		if d.Window != nil {
			d.Window.close()
		}
		for _, q := range d.Queues {
			q.Close()
		}
		d.Mem.Close()
	})
	return nil
}

// Queue returns ring i.
func (d *Device) Queue(i int) *Queue { return d.Queues[i] }

// Do sends one FUSE request on ring queue and returns the reply bytes the
// back end wrote (fuse_out_header and what follows, cut to the used
// length). in is fuse_in_header plus arguments; writeData goes in page
// segments after them (WRITE); outSize is the writable size including the
// 16-byte out header, or 0 for a request without a reply, which is then
// laid out as Linux sends FORGET (one readable buffer). For READ, READDIR
// and READDIRPLUS the reply data goes in page segments.
func (d *Device) Do(queue int, in, writeData []byte, outSize int) ([]byte, error) {
	r := FuseRequest{In: in, InPages: writeData, Indirect: d.opts.Indirect}
	switch {
	case outSize == 0:
		r.NoReply, r.Packed = true, true
	case outSize < FuseOutHeaderSize:
		return nil, fmt.Errorf("vmm: outSize %d is smaller than fuse_out_header", outSize)
	default:
		if len(in) >= 8 && pageReply(le.Uint32(in[4:])) {
			r.OutPages = outSize - FuseOutHeaderSize
		} else {
			r.OutArgs = outSize - FuseOutHeaderSize
		}
	}
	return d.DoRequest(queue, r)
}

// DoRequest submits r on ring queue and waits for the reply.
func (d *Device) DoRequest(queue int, r FuseRequest) ([]byte, error) {
	if queue < 0 || queue >= len(d.Queues) {
		return nil, fmt.Errorf("vmm: no ring %d", queue)
	}
	fc, err := d.Queues[queue].SubmitFuse(r)
	if err != nil {
		return nil, err
	}
	return fc.Wait(d.opts.Timeout)
}

// pageReply reports whether Linux receives the reply data of op into pages.
func pageReply(op uint32) bool {
	switch op {
	case OpRead, OpReaddir, OpReaddirplus:
		return true
	}
	return false
}

// ---- backend channel ----

// BackendHandler answers one backend request; the answer is sent when the
// request has NEED_REPLY.
type BackendHandler func(m *Message) (reply uint64)

// ServeBackend answers backend requests with h until the channel closes; a
// nil h answers 1 to everything, as QEMU 7.2 answers requests it does not
// know (dev.ServeFSIO serves FS_IO the same way otherwise). It returns at
// once; it does nothing if no backend channel was negotiated.
func (d *Device) ServeBackend(h BackendHandler) {
	if d.Backend == nil {
		return
	}
	go func() {
		for {
			m, err := d.Backend.RecvTimeout(-1)
			if err != nil {
				return
			}
			var v uint64 = 1
			if h != nil {
				v = h(m)
			}
			m.CloseFds()
			if m.Flags&FlagNeedReply != 0 {
				if d.Backend.Reply(m, U64(v)) != nil {
					return
				}
			}
		}
	}()
}

// ServeFSIO performs an FS_IO request as the VMM would: for each entry,
// pread into or pwrite from guest memory at c_offset through the attached
// fd. It returns the total bytes transferred (short at end of file), or
// ^0 on a malformed request or an I/O error before any byte moved. Other
// requests get 1. It is a BackendHandler.
func (d *Device) ServeFSIO(m *Message) uint64 {
	if m.Request != BackendFSIO {
		return 1
	}
	f, err := ParseFSIO(m.Payload)
	if err != nil || len(m.Fds) != 1 {
		return ^uint64(0)
	}
	fd := m.Fds[0]
	var total uint64
	for i := range 8 {
		if f.Len[i] == 0 {
			continue
		}
		buf, err := d.Mem.Slice(f.COffset[i], f.Len[i])
		if err != nil {
			return failOr(total)
		}
		var n int
		switch f.Flags[i] {
		case FSIORead:
			n, err = unix.Pread(fd, buf, int64(f.FdOffset[i]))
		case FSIOWrite:
			n, err = unix.Pwrite(fd, buf, int64(f.FdOffset[i]))
		default:
			err = errors.New("bad flags")
		}
		if err != nil {
			return failOr(total)
		}
		total += uint64(n)
		if uint64(n) < f.Len[i] {
			break
		}
	}
	return total
}

func failOr(total uint64) uint64 {
	if total > 0 {
		return total
	}
	return ^uint64(0)
}
