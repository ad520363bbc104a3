package bench

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

var le = binary.LittleEndian

// Ring is a lean driver side of one virtqueue, split or packed, for
// throughput runs:
// it takes over a ring that test/vmm set up (vmm.Device.Start) once the
// ring is idle, and from then on owns it. Unlike vmm.Queue it never
// allocates on the request path, keeps no per-chain map or channel, and
// is driven by a single goroutine that both submits and reaps:
//
//   - heads are the caller's slot numbers (descriptor i is slot i's head,
//     pointing at the slot's indirect table, as Linux does when
//     INDIRECT_DESC is negotiated);
//   - Add writes avail.ring entries, Publish stores {flags, idx} with one
//     atomic 32-bit store and decides whether to kick as
//     virtqueue_kick_prepare does (EVENT_IDX: vring_need_event against
//     avail_event), so a batch of requests costs at most one kick;
//   - Next walks the used ring; Wait sets used_event to the last seen used
//     index (virtqueue_enable_cb), re-checks, and blocks in read(2) on the
//     ring's call eventfd, which this Ring created and sent with
//     SET_VRING_CALL (a guest unmasking its vector).
//
// On a packed ring (packed.go) every request is one slot: Add writes the
// head's descriptor into the next slot, flags last, and Next reads the used
// descriptors the device wrote in their place.
type Ring struct {
	Index  int
	size   uint16
	mask   uint16
	desc   []byte
	avail  []byte
	used   []byte
	kickFd int // non-blocking eventfd, ours
	call   int // blocking eventfd, ours
	one    [8]byte

	eventIdx bool
	packed   *packedDriver // nil: split
	availIdx uint16
	pending  uint16 // published since the last kick decision
	lastUsed uint16
	buf8     [8]byte

	// Spin is how long Wait polls used.idx before sleeping.
	Spin time.Duration
	// Raw sleeps in read(2) without telling the Go scheduler (no P
	// hand-off, no extra thread wake-ups).
	Raw      bool
	lastWait time.Duration

	// For the watchdog: what a sleeping Wait waits for.
	asleep  atomic.Bool
	aborted atomic.Bool   // Interrupt was called: Wait returns errAborted
	tid     atomic.Int32  // the driving goroutine's thread
	sleep   atomic.Uint64 // Sleeps << 32 | last seen used index << 16 | used_event
	// Stalls the watchdog saw (see Run).
	Withheld, Starved atomic.Uint64

	// Counters (owned by the driving goroutine).
	Spins   uint64 // waits satisfied while polling
	Kicks   uint64 // kick eventfd writes
	Sleeps  uint64 // blocking waits on the call eventfd
	Wakeups uint64 // call eventfd reads that returned
}

// TakeoverAll makes every ring of dev a Ring. The rings must be idle
// (nothing in flight). It replays what QEMU does when a paused VM resumes
// (vhost_dev_stop, then vhost_dev_start): SET_VRING_ENABLE 0 and
// GET_VRING_BASE on every ring (dev.Stop), then per ring SET_VRING_NUM,
// SET_VRING_BASE at the returned base, SET_VRING_ADDR of the same ring
// and SET_VRING_KICK with a kick eventfd owned by the Ring, then
// SET_VRING_ENABLE 1 and SET_VRING_CALL with the Ring's call eventfd. It
// ends with a GET_FEATURES round trip, so the back end has processed every
// message before the first request. From then on the vmm.Queue objects
// are idle (their interrupt handlers listen on call fds nobody signals).
func TakeoverAll(dev *vmm.Device) ([]*Ring, error) {
	for i, q := range dev.Queues {
		if n := q.InFlight(); n != 0 {
			return nil, fmt.Errorf("bench: ring %d has %d chains in flight", i, n)
		}
	}
	bases, err := dev.Stop()
	if err != nil {
		return nil, err
	}
	c := dev.Conn
	var rings []*Ring
	fail := func(err error) ([]*Ring, error) {
		for _, r := range rings {
			r.Close()
		}
		return nil, err
	}
	packed := dev.Negotiated(vmm.FRingPacked)
	for i, q := range dev.Queues {
		if !packed && bases[i] != uint32(q.AvailIdx()) {
			return fail(fmt.Errorf("bench: ring %d: GET_VRING_BASE %d, but avail.idx is %d", i, bases[i], q.AvailIdx()))
		}
		var r *Ring
		var err error
		if packed {
			r, err = newPackedRing(dev.Mem, q, dev.Negotiated(vmm.FEventIdx), bases[i])
		} else {
			r, err = newRing(dev.Mem, q, dev.Negotiated(vmm.FEventIdx))
		}
		if err != nil {
			return fail(err)
		}
		rings = append(rings, r)
		a, err := q.VringAddr()
		if err != nil {
			return fail(err)
		}
		if err := errors.Join(c.SetVringNum(uint32(i), uint32(r.size)), c.SetVringBase(uint32(i), bases[i]),
			c.SetVringAddr(a), c.SetVringKick(uint32(i), r.kickFd)); err != nil {
			return fail(err)
		}
	}
	if dev.Negotiated(vmm.FProtocolFeatures) {
		for i := range rings {
			if err := c.SetVringEnable(uint32(i), true); err != nil {
				return fail(err)
			}
		}
	}
	for i, r := range rings {
		if err := c.SetVringCall(uint32(i), r.call); err != nil {
			return fail(err)
		}
	}
	if _, err := c.GetFeatures(); err != nil {
		return fail(err)
	}
	return rings, nil
}

func newRing(mem *vmm.Memory, q *vmm.Queue, eventIdx bool) (*Ring, error) {
	size := q.Size()
	if size == 0 || size&(size-1) != 0 {
		return nil, fmt.Errorf("bench: ring size %d is not a power of two", size)
	}
	a := q.Addrs()
	dl, al, ul := vmm.RingBytes(size)
	r := &Ring{Index: q.Index, size: size, mask: size - 1, eventIdx: eventIdx,
		availIdx: q.AvailIdx(), lastUsed: q.LastUsed(), kickFd: -1, call: -1}
	var err error
	if r.desc, err = mem.Slice(a.Desc, dl); err != nil {
		return nil, err
	}
	if r.avail, err = mem.Slice(a.Avail, al); err != nil {
		return nil, err
	}
	// vmm allocates 4 bytes of slack after the used ring for the aligned
	// word holding avail_event.
	if r.used, err = mem.Slice(a.Used, ul+4); err != nil {
		return nil, err
	}
	if a.Avail%4 != 0 || a.Used%4 != 0 {
		return nil, errors.New("bench: avail and used rings must be 4-byte aligned")
	}
	return r, r.openFds()
}

// openFds makes the ring's call and kick eventfds.
func (r *Ring) openFds() error {
	var err error
	if r.call, err = unix.Eventfd(0, unix.EFD_CLOEXEC); err != nil {
		return err
	}
	if r.kickFd, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
		r.Close()
		return err
	}
	le.PutUint64(r.one[:], 1)
	return nil
}

// Close closes the eventfds.
func (r *Ring) Close() {
	for _, p := range []*int{&r.call, &r.kickFd} {
		if *p >= 0 {
			unix.Close(*p)
			*p = -1
		}
	}
}

// kick writes the kick eventfd.
func (r *Ring) kick() error {
	_, err := unix.Write(r.kickFd, r.one[:])
	if err == unix.EAGAIN { // counter saturated: the back end has a kick pending anyway
		err = nil
	}
	return err
}

// Size is the number of descriptors.
func (r *Ring) Size() uint16 { return r.size }

// SetDesc writes descriptor i (packed: the descriptor Add(i) writes).
func (r *Ring) SetDesc(i uint16, d vmm.Desc) {
	if r.packed != nil {
		r.packed.heads[i] = d
		return
	}
	b := r.desc[int(i)*vmm.DescSize:]
	le.PutUint64(b, d.Addr)
	le.PutUint32(b[8:], d.Len)
	le.PutUint16(b[12:], d.Flags)
	le.PutUint16(b[14:], d.Next)
}

// Add puts head in the next avail slot without publishing it.
func (r *Ring) Add(head uint16) {
	if r.packed != nil {
		r.packed.add(r, head)
		r.pending++
		return
	}
	le.PutUint16(r.avail[4+2*int(r.availIdx&r.mask):], head)
	r.availIdx++
	r.pending++
}

// Publish makes the added heads visible and kicks if the device asked for
// it. The atomic store is a full barrier (XCHG on amd64), so the read of
// avail_event that follows is ordered after it.
func (r *Ring) Publish() error {
	if r.pending == 0 {
		return nil
	}
	if r.packed != nil {
		kick := r.packed.needKick(r)
		r.pending = 0
		if !kick {
			return nil
		}
		r.Kicks++
		return r.kick()
	}
	w := (*uint32)(unsafe.Pointer(&r.avail[0]))
	flags := atomic.LoadUint32(w) & 0xffff
	atomic.StoreUint32(w, flags|uint32(r.availIdx)<<16)
	old := r.availIdx - r.pending
	r.pending = 0
	var kick bool
	if r.eventIdx {
		kick = vmm.NeedEvent(r.availEvent(), r.availIdx, old)
	} else {
		kick = r.usedFlags()&vmm.UsedNoNotify == 0
	}
	if !kick {
		return nil
	}
	r.Kicks++
	return r.kick()
}

func (r *Ring) usedWord() uint32 { return atomic.LoadUint32((*uint32)(unsafe.Pointer(&r.used[0]))) }

func (r *Ring) usedIdx() uint16   { return uint16(r.usedWord() >> 16) }
func (r *Ring) usedFlags() uint16 { return uint16(r.usedWord()) }

func (r *Ring) availEvent() uint16 {
	return uint16(atomic.LoadUint32((*uint32)(unsafe.Pointer(&r.used[4+8*int(r.size)]))))
}

// setUsedEvent stores used_event (the low half of an aligned word whose
// high half is padding before the used ring) with a full barrier.
func (r *Ring) setUsedEvent(v uint16) {
	w := (*uint32)(unsafe.Pointer(&r.avail[4+2*int(r.size)]))
	for {
		old := atomic.LoadUint32(w)
		if atomic.CompareAndSwapUint32(w, old, old&^0xffff|uint32(v)) {
			return
		}
	}
}

// Next returns the next used element, if the device has published one
// since the last call.
func (r *Ring) Next() (id, n uint32, ok bool) {
	if r.packed != nil {
		return r.packed.next(r)
	}
	if r.lastUsed == r.usedIdx() {
		return 0, 0, false
	}
	e := r.used[4+8*int(r.lastUsed&r.mask):]
	r.lastUsed++
	return le.Uint32(e), le.Uint32(e[4:]), true
}

// HasUsed reports whether used elements are waiting.
func (r *Ring) HasUsed() bool {
	if r.packed != nil {
		return r.packed.usedAt(r, r.lastUsed, r.packed.usedWrap)
	}
	return r.usedIdx() != r.lastUsed
}

// Wait blocks until a used element is waiting: it first polls used.idx
// for up to Spin, then asks for an interrupt once batch more elements
// have been used (EVENT_IDX: used_event = last seen + batch - 1; batch 1
// is Linux's virtqueue_enable_cb; without EVENT_IDX at the next one),
// re-checks used.idx after that full barrier, and sleeps on the call
// eventfd. batch must not exceed the requests in flight.
func (r *Ring) Wait(batch int) error {
	if r.aborted.Load() {
		return errAborted
	}
	if r.HasUsed() {
		return nil
	}
	var start time.Time
	if r.Spin > 0 {
		// Adaptive: poll only while completions have recently come
		// within the spin window (a 4 KiB stream), not when they take
		// longer (1 MiB requests), where it would only burn a CPU the
		// back end may need.
		start = time.Now()
		if r.lastWait < r.Spin {
			deadline := start.Add(r.Spin)
			for i := 1; ; i++ {
				if r.HasUsed() {
					r.Spins++
					r.lastWait = time.Since(start)
					return nil
				}
				if i%64 == 0 && time.Now().After(deadline) {
					break
				}
			}
		}
		defer func() { r.lastWait = time.Since(start) }()
	}
	ev := r.lastUsed
	if batch > 1 {
		ev += uint16(batch - 1)
	}
	var evWrap bool
	if r.packed != nil {
		ev, evWrap = r.packed.advance(r.lastUsed, r.packed.usedWrap, max(batch-1, 0), r.size)
	}
	for {
		if r.packed != nil {
			if r.packed.armInterrupt(r, ev, evWrap) {
				return nil
			}
		} else {
			if r.eventIdx {
				r.setUsedEvent(ev)
			}
			if r.usedIdx()-r.lastUsed > ev-r.lastUsed {
				return nil
			}
		}
		r.Sleeps++
		r.sleep.Store(uint64(uint32(r.Sleeps))<<32 | uint64(r.lastUsed)<<16 | uint64(packedPos(ev, evWrap)))
		r.asleep.Store(true)
		var err error
		if r.Raw {
			_, _, e := unix.RawSyscall(unix.SYS_READ, uintptr(r.call), uintptr(unsafe.Pointer(&r.buf8[0])), 8)
			if e != 0 {
				err = e
			}
		} else {
			_, err = unix.Read(r.call, r.buf8[:])
		}
		r.asleep.Store(false)
		if err != nil {
			if err == unix.EINTR {
				continue
			}
			return err
		}
		r.Wakeups++
		if r.aborted.Load() {
			return errAborted
		}
		if r.HasUsed() {
			return nil
		}
	}
}

var errAborted = errors.New("bench: ring wait interrupted")

// Interrupt makes Wait return errAborted, now and from then on (used to
// abort a run).
func (r *Ring) Interrupt() {
	r.aborted.Store(true)
	var b [8]byte
	le.PutUint64(b[:], 1)
	unix.Write(r.call, b[:])
}

// Diag describes the ring's state for an error message, while its driving
// goroutine may still run: it reads only the shared ring words and what
// Wait published for the watchdog. The counters are in Counters.
func (r *Ring) Diag() string {
	if r.packed != nil {
		return r.packed.diag(r)
	}
	usedEvent := uint16(atomic.LoadUint32((*uint32)(unsafe.Pointer(&r.avail[4+2*int(r.size)]))))
	availIdx := uint16(atomic.LoadUint32((*uint32)(unsafe.Pointer(&r.avail[0]))) >> 16)
	waits := "driver not asleep"
	if r.asleep.Load() {
		v := r.sleep.Load()
		waits = fmt.Sprintf("driver asleep having seen %d, waiting for used.idx past %d", uint16(v>>16), uint16(v))
	}
	return fmt.Sprintf("ring %d: avail.idx %d, used.idx %d, used_event %d, avail_event %d, used.flags %#x, %s",
		r.Index, availIdx, r.usedIdx(), usedEvent, r.availEvent(), r.usedFlags(), waits)
}

// Counters describes the driver's counters; call it only after the
// driving goroutine returned.
func (r *Ring) Counters() string {
	return fmt.Sprintf("ring %d: driver saw used.idx %d, kicks %d, sleeps %d, wakeups %d", r.Index, r.lastUsed, r.Kicks, r.Sleeps, r.Wakeups)
}

// checkLost is the watchdog's probe: if Wait sleeps although the elements
// it waits for were used, it reports true and which sleep it is. A busy
// ring sleeps thousands of times a second, and with replies signalled per
// batch most of its sleeps look lost for a moment: only the same sleep
// seen lost again and again is a stall.
func (r *Ring) checkLost() (sleep uint64, lost bool) {
	if !r.asleep.Load() {
		return 0, false
	}
	v := r.sleep.Load()
	last, ev := uint16(v>>16), uint16(v)
	if r.packed != nil {
		return v, r.packed.usedAt(r, ev&0x7fff, ev&0x8000 != 0)
	}
	return v, r.usedIdx()-last > ev-last
}
