// Package vmm is a test front end for vhost-user-fs back ends: it plays the
// part of QEMU (the vhost-user master) and of the Linux guest's virtio-fs
// driver, over a real unix socket, against a daemon running in another
// process.
//
// It is an independent oracle: it shares no code with the daemon under test
// and depends only on the standard library and golang.org/x/sys/unix.
//
// The pieces, bottom up:
//
//   - Memory is guest RAM: memfd-backed regions placed in a guest-physical
//     address space, each with a fake "userspace address" (QEMU's HVA) that
//     differs from its guest-physical address, so a back end that confuses
//     the two translations fails. Several regions may share one memfd, and
//     regions may be GPA-contiguous so that buffers can straddle them.
//     A small allocator hands out guest buffers.
//
//   - Conn is the vhost-user transport: raw message primitives (any header,
//     any payload, any fds, even partial messages) and one typed helper per
//     front-end request.
//
//   - Queue is the driver side of a virtqueue living in Memory, split or
//     packed (VIRTIO_F_RING_PACKED, packed.go) behind the same API:
//     descriptor management, publication with the proper barriers, kick
//     suppression (EVENT_IDX or VRING_USED_F_NO_NOTIFY; on packed rings
//     the device event area), and an "interrupt handler" goroutine that
//     collects completions when the back end signals the call eventfd.
//     As an oracle it records device misbehaviour (Violations): ids not in
//     flight, used.idx jumps, used lengths beyond a packed chain's
//     writable bytes. It also exposes raw ring access of each layout for
//     malformed-chain tests; a layout's raw accessors panic on the other.
//
//   - FuseRequest (request.go) lays a FUSE request out in a chain exactly
//     as Linux's virtio_fs driver does: in header, arguments and each data
//     page in separate buffers, then out header, reply arguments and reply
//     pages; one indirect descriptor when INDIRECT_DESC is negotiated.
//
//   - Device ties them together the way QEMU 7.2 does: Start performs the
//     exact start-up message flow of vhost-user-fs-pci, and StopQueue,
//     RestartQueue, Stop, Restart and GuestReset replay the ring lifecycle
//     messages of pause, resume and guest reboot; AddRegion and
//     RemoveRegion replay memory hotplug; Backend is the VMM's end of the
//     backend-request channel. Device.Do sends one FUSE request and returns
//     the reply bytes. Packed rings are asked for with Bit(FRingPacked) in
//     Options.Features (split if the back end does not offer them, as
//     QEMU's packed=on) or required with Options.RequireFeatures (Init
//     fails with ErrNotOffered); their vring bases carry both indices and
//     wrap counters (PackedBase), starting at PackedResetBase.
//
//   - The shared-memory window (shmem.go): with Options.Shmem the front end
//     acks SHMEM, asks GET_SHMEM_CONFIG and reserves region 0 at
//     Options.WindowBase; ServeWindow (a BackendHandler) and
//     MapWindow/UnmapWindow map files into it as QEMU 11.1 does, announcing
//     each mapping with ADD_MEM_REG / REM_MEM_REG before answering.
//
//   - Queue.AddMalformed (malformed.go) breaks an otherwise valid request
//     in one of the ways a device must survive (loops, out-of-range
//     indices, addresses outside RAM or wrapping, bad indirect tables,
//     readable-after-writable, avail.idx jumps; on packed rings duplicate
//     ids and chains that never end). Malformations and
//     PackedMalformations list the kinds of each layout, and
//     Malformation.Reaction says what a correct device does.
//
//   - fuse.go has just enough FUSE wire encoding (INIT, LOOKUP, GETATTR,
//     OPEN, READ, WRITE, RELEASE, FORGET, DESTROY) for tests to drive a
//     session through a Session.
//
// A typical test:
//
//	dev, err := vmm.Start(socketPath, vmm.DefaultOptions())
//	...
//	defer dev.Close()
//	s := vmm.NewSession(dev, 1)
//	init, err := s.Init(vmm.KernelMinor, vmm.LinuxInitFlags)
//	entry, err := s.Lookup(vmm.RootID, "file.txt")
//
// The same on packed rings, skipped where the back end has none:
//
//	opts := vmm.DefaultOptions()
//	opts.RequireFeatures = vmm.Bit(vmm.FRingPacked)
//	dev, err := vmm.Start(socketPath, opts)
//	if errors.Is(err, vmm.ErrNotOffered) {
//		t.Skip(err)
//	}
//
// Concurrency: Conn serialises request/reply exchanges, Queue and Memory
// are safe for concurrent use, and Chains may be waited on from any
// goroutine; the Device lifecycle methods (Start, Stop, Restart...) must
// not run concurrently with each other.
//
// Addresses: GPA means guest-physical address (what descriptors carry), HVA
// means the front end's virtual address (what SET_VRING_ADDR and the memory
// table's userspace_addr carry). Everything in guest memory is little endian.
package vmm
